# The one-node Slurm cluster of the slurm launch tests, as a ctest fixture.
# Included from tests/cpp/CMakeLists.txt after the launch test binaries are
# declared. tests/launch/slurm.sh starts it in a short scratch directory of
# this build (munged's socket path must stay under 108 bytes) and stops it.
string(MD5 _deepnex_build_hash "${PROJECT_BINARY_DIR}")
string(SUBSTRING "${_deepnex_build_hash}" 0 8 _deepnex_build_hash)
set(DEEPNEX_TEST_SLURM_DIR "/tmp/deepnex-slurm-${_deepnex_build_hash}")

add_test(NAME slurm_cluster_start
         COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/slurm.sh start ${DEEPNEX_TEST_SLURM_DIR})
add_test(NAME slurm_cluster_stop
         COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/slurm.sh stop ${DEEPNEX_TEST_SLURM_DIR})
set_tests_properties(slurm_cluster_start PROPERTIES FIXTURES_SETUP slurm TIMEOUT 180
                     RESOURCE_LOCK slurm)
set_tests_properties(slurm_cluster_stop PROPERTIES FIXTURES_CLEANUP slurm TIMEOUT 60
                     RESOURCE_LOCK slurm)

# The gtest cases are only known when ctest runs (gtest_discover_tests), so a
# file that ctest includes after the discovered tests gives every slurm case
# the fixture and the cluster's config: all of launch_slurm_test, and the
# contract cases of launch_test instantiated for "slurm" (named
# "Suite.Case/slurm  # GetParam() = ..."). RESOURCE_LOCK: the
# cases count the cluster's 4 GPUs, so they run one at a time.
set(_deepnex_slurm_props "${CMAKE_CURRENT_BINARY_DIR}/slurm_fixture.cmake")
file(WRITE "${_deepnex_slurm_props}" "
set(_slurm_tests \${launch_slurm_test_TESTS})
foreach(t IN LISTS launch_test_TESTS)
  if(t MATCHES \"/slurm( |$)\")
    list(APPEND _slurm_tests \"\${t}\")
  endif()
endforeach()
foreach(t IN LISTS _slurm_tests)
  set_tests_properties(\"\${t}\" PROPERTIES FIXTURES_REQUIRED slurm RESOURCE_LOCK slurm
    ENVIRONMENT \"DEEPNEX_TEST_SLURM_CONF=${DEEPNEX_TEST_SLURM_DIR}/slurm.conf\")
endforeach()
")
# Deferred to the end of the directory, so that ctest includes it after the
# files of every gtest_discover_tests call, wherever this file is included.
cmake_language(DEFER CALL set_property DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES
               "${_deepnex_slurm_props}")
