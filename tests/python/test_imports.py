"""`import deepnex` and the `deepnex` command start light (issue #16's time
to a prompt): the compiled module, numpy and the submodules load on first
use (PEP 562), and every public name still resolves. Each check runs in a
fresh interpreter, as sys.modules of this one holds what other tests
imported."""

import subprocess
import sys

import pytest

import deepnex

HEAVY = ("deepnex._C", "numpy", "deepnex.collective", "deepnex.gpu", "deepnex.launch",
         "deepnex.job", "deepnex.tune", "deepnex.data", "deepnex.ps")


def loaded_after(code):
    """Which of HEAVY are in sys.modules of a fresh interpreter after `code`."""
    out = subprocess.run(
        [sys.executable, "-c", f"import sys\n{code}\n"
         f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"],
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_deepnex_loads_neither_the_compiled_module_nor_numpy():
    assert loaded_after("import deepnex") == "[]"
    # Errors need nothing compiled either.
    assert loaded_after("from deepnex import NotFoundError, DeepnexError") == "[]"


def test_a_name_loads_what_it_needs_and_no_more():
    assert loaded_after("import deepnex; deepnex.parse_byte_size('1KiB')") == "['deepnex._C']"
    assert loaded_after("import deepnex; deepnex.gpu") == "['deepnex._C', 'deepnex.gpu']"
    assert loaded_after("import deepnex; deepnex.collective") == \
        "['deepnex._C', 'deepnex.collective', 'numpy']"


def test_every_public_name_resolves():
    code = ("import deepnex, types\n"
            "for n in deepnex.__all__ + ['collective', 'gpu', 'data', 'launch', 'job', 'tune', "
            "'_C']:\n"
            "    getattr(deepnex, n)\n"
            "print(deepnex.parse_byte_size('8GiB'), deepnex.format_byte_size(1024),\n"
            "      deepnex.__version__.count('.'), deepnex.report is deepnex.tune.report,\n"
            "      deepnex.gpu is sys.modules['deepnex.gpu'], deepnex.Context is deepnex._C.Context)\n"
            "from deepnex import *\n"
            "print(Context is deepnex.Context, 'launch' in dir(deepnex))\n")
    out = loaded_after(code).splitlines()
    assert out[:2] == ["8589934592 1KiB 2 True True True", "True True"]
    # init() still reaches the compiled module (test_core pins what it reads).
    with pytest.raises(deepnex.InvalidArgumentError, match="DEEPNEX_JOB_ID is not set"):
        deepnex.init({})


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="module 'deepnex' has no attribute 'nope'"):
        deepnex.nope
    assert not hasattr(deepnex, "torch_stuff")


def test_the_session_commands_parse_without_the_other_commands_modules():
    code = ("from deepnex.__main__ import main\n"
            "try:\n"
            "    main(['shell', '--help'])\n"
            "except SystemExit:\n"
            "    pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('deepnex._cli_')))")
    out = loaded_after(code).splitlines()
    assert out[0].startswith("usage: deepnex shell [-h]")
    assert out[-2:] == ["['deepnex._cli_common', 'deepnex._cli_session']", "[]"]


def test_each_fast_command_is_its_modules_own():
    """__main__._COMMAND_MODULES names, for each command, the module that
    adds it: parsed with that module alone it is the same command."""
    import importlib

    from deepnex import __main__ as cli
    for command, module in cli._COMMAND_MODULES.items():
        added = []

        class Recorder:
            def add_parser(self, name, **kwargs):
                added.append(name)
                import argparse
                return argparse.ArgumentParser(prog=name)
        importlib.import_module(f"deepnex.{module}").add_commands(Recorder())
        assert command in added, (command, module, added)
