"""benchmarks/scaling's parsing of a run's output, and benchmarks/plot.py on
the CSV shapes of scaling, launch_bench and allreduce_bench."""

import importlib.machinery
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")


def load(name):
    path = os.path.join(BENCH, name)
    loader = importlib.machinery.SourceFileLoader(name.replace(".py", ""), path)
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


OUTPUT = """\
[ps 0] deepnex-ps listening on 127.0.0.1:44627 (mode sync, 2 workers, sgd(lr=0.1))
[worker 0] epoch   1  loss 1.4269  test accuracy 0.8472  (0.1 s)
[worker 0] epoch   2  loss 0.3109  test accuracy 0.9111  (0.2 s)
[worker 0] epoch   3  loss 0.1738  test accuracy 0.8933  (0.2 s)
[worker 0] epoch   4  loss 0.1523  test accuracy 0.9306  (0.3 s)
[worker 0] summary: digits mlp_numpy mode=ps workers=2 epochs=4 test_accuracy=0.9306 \
time=0.3s samples_per_s=14370
"""


def test_scaling_parses_throughput_and_the_first_epoch_at_the_target():
    scaling = load("scaling")
    r = scaling.parse_output(OUTPUT, 0.9)
    # 1437 samples an epoch at 14370/s: 0.1 s an epoch; first at 0.9 in epoch 2.
    assert r["samples_per_s"] == 14370 and r["accuracy"] == 0.9306 and r["epochs"] == 4
    assert r["epochs_to_target"] == 2
    assert r["time_to_target"] == pytest.approx(0.2)
    never = scaling.parse_output(OUTPUT, 0.95)
    assert never["epochs_to_target"] is None and never["time_to_target"] is None
    with pytest.raises(ValueError, match="no summary line"):
        scaling.parse_output(OUTPUT.rsplit("[worker 0] summary", 1)[0], 0.9)


def _plot_module():
    pytest.importorskip("matplotlib")
    sys.path.insert(0, BENCH)
    try:
        import plot
    finally:
        sys.path.pop(0)
    return plot


CSVS = {
    "scaling.csv": "workers,model,mode,samples_per_s,time_to_target_s,final_accuracy,"
                   "speedup,job_s\n1,numpy,sync,11840,0.12,0.93,1.0,10.2\n"
                   "2,numpy,sync,5068,,0.89,0.43,16.3\n",
    "launch.csv": "backend,round,start_to_running_ms,start_to_exit_ms\n"
                  "process,0,100.4,134.7\nprocess,1,121.4,278.2\noci,0,440,680\n"
                  "oci,1,450,690\n",
    "allreduce.csv": "size_bytes,ranks,host,shm_busbw_gbps,tcp_busbw_gbps,gloo_busbw_gbps,"
                     "mpi_busbw_gbps\n1024,2,node7,0.01,0.02,0.01,0.01\n"
                     "1048576,2,node7,1.2,1.3,0.5,0.9\n67108864,2,node7,6.0,3.0,1.0,4.0\n",
    "ps.csv": "workers,mode,mb,partitions,rounds,repeat,deepnex_gbps,torch_rpc_gbps,"
              "torch_rpc_malloc_gbps,raw_tcp_gbps,ratio_torch,ratio_torch_malloc,ratio_tcp\n"
              "1,async,64,8,20,1,3.0,1.0,1.5,4.0,3,2,0.75\n"
              "2,async,64,8,20,1,4.0,1.25,1.5,5.0,3.2,2.67,0.8\n",
    "alloc.csv": "size_bytes,alloc_ms,release_ms\n1024,0.5,0.25\n1048576,1.5,1.25\n",
}


@pytest.fixture
def charts(tmp_path):
    """{csv name: (path, Figure)} for the sample CSVs; figures closed after."""
    plot = _plot_module()
    import matplotlib.pyplot as plt
    out = {}
    for name, text in CSVS.items():
        (tmp_path / name).write_text(text)
        out[name] = (tmp_path / name, plot.figure(tmp_path / name))
    yield plot, out
    for _, fig in out.values():
        plt.close(fig)


def _ticks(ax):
    return [t.get_text() for t in ax.get_xticklabels()]


def _legend(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_plot_allreduce_chart_says_what_where_and_names_the_peers(charts):
    plot, figs = charts
    (ax,) = figs["allreduce.csv"][1].axes
    assert ax.get_title() == ("allreduce bus bandwidth, float32 sum\n"
                              "2 ranks on one host (node7); higher is better")
    assert ax.get_xscale() == "log"
    assert _ticks(ax) == ["1 KiB", "4 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB", "4 MiB",
                          "16 MiB", "64 MiB"]
    assert ax.get_xlabel() == "message size (log scale)"
    assert ax.get_ylabel() == "bus bandwidth, GB/s (1e9 B/s)"
    assert _legend(ax) == ["deepnex shm", "deepnex tcp", "torch gloo", "Open MPI"]
    assert plot.allreduce_series(plot.read_csv(figs["allreduce.csv"][0]))["deepnex shm"] == [
        (1024.0, 0.01), (1048576.0, 1.2), (67108864.0, 6.0)]
    assert [plot.human_bytes(n) for n in (512, 1024, 1536, 64 << 20, 1 << 30)] == [
        "512 B", "1 KiB", "1.5 KiB", "64 MiB", "1 GiB"]


def test_plot_titles_of_ps_scaling_launch_and_generic_charts(charts):
    plot, figs = charts
    (ax,) = figs["ps.csv"][1].axes
    assert ax.get_title() == ("parameter server push+pull goodput, 64 MiB float32 model in 8 "
                              "partitions\n1 server and 1-2 workers on one host (127.0.0.1), "
                              "median of 20 rounds")
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_xscale()) == (
        "workers", "goodput, GB/s", "linear")
    assert _ticks(ax) == ["1", "2"]
    assert _legend(ax) == ["deepnex async", "torch rpc", "torch rpc + malloc",
                           "raw TCP (loopback ceiling)"]
    fig = figs["scaling.csv"][1]
    assert fig._suptitle.get_text() == ("digits MLP under deepnex run: 1-2 workers on one host "
                                        "(local allocator, process backend)")
    left, right = fig.axes
    assert (left.get_ylabel(), right.get_ylabel()) == ("training throughput, samples/s",
                                                       "time to target accuracy, s")
    assert _legend(left) == ["NumPy MLP, sync PS"]
    assert plot.scaling_series(plot.read_csv(figs["scaling.csv"][0]), "time_to_target_s") == {
        "NumPy MLP, sync PS": [(1.0, 0.12), (2.0, None)]}
    (ax,) = figs["launch.csv"][1].axes
    assert ax.get_title() == ("launch latency of a trivial container (true) by backend\n"
                              "one host, 2 rounds each; lower is better")
    assert _ticks(ax) == ["deepnex process", "deepnex oci (runc)"]
    # Unknown CSVs: the file name, a size axis for bytes, the unit on the axis.
    (ax,) = figs["alloc.csv"][1].axes
    assert (ax.get_title(), ax.get_xscale(), ax.get_xlabel(), ax.get_ylabel()) == (
        "alloc", "log", "size (log scale)", "ms")
    assert _ticks(ax) == ["1 KiB", "4 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB"]
    assert _legend(ax) == ["alloc", "release"]


def test_plot_writes_a_png_per_csv(charts, tmp_path):
    plot, figs = charts
    out = tmp_path / "png"
    assert plot.main([str(path) for path, _ in figs.values()] + ["--out", str(out)]) == 0
    for name in CSVS:
        png = out / name.replace(".csv", ".png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "empty.csv").write_text("size_bytes,x_gbps\n")
    assert plot.main([str(tmp_path / "empty.csv"), "--out", str(out)]) == 1


BUILD_DIR = os.environ.get("DEEPNEX_BUILD_DIR", os.path.join(ROOT, "build"))


def test_ps_bench_process_cpu_counts_ended_threads():
    ps_bench = load("ps_bench")
    import threading
    import time

    def spin(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
    before = ps_bench.process_cpu_s(os.getpid())
    worker = threading.Thread(target=spin, args=(0.3,))
    worker.start()
    worker.join()
    # The thread has ended; its 0.3 s stay in the process's count (to a
    # clock tick either side).
    assert ps_bench.process_cpu_s(os.getpid()) - before >= 0.28


@pytest.mark.skipif(not all(os.path.exists(os.path.join(BUILD_DIR, "bin", b))
                            for b in ("deepnex-ps", "ps_bench_worker", "tcp_ceiling")),
                    reason="deepnex-ps, ps_bench_worker or tcp_ceiling not built")
def test_ps_bench_reports_the_cpu_each_round_costs_beside_raw_tcp():
    import subprocess
    out = subprocess.run(
        [sys.executable, os.path.join(BENCH, "ps_bench"), "--build", BUILD_DIR,
         "--bytes", "1M", "--rounds", "10", "--warmup", "2", "--workers", "1,2",
         "--modes", "sync", "--transports", "tcp,shm", "--torch", ""],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    table = out.stdout.split("ps_bench: CPU per timed round", 1)[1].splitlines()
    assert table[1].split() == ["size", "workers", "deepnex", "sync", "deepnex", "sync", "shm",
                                "raw", "TCP"]
    rows = [line.split() for line in table[3:5]]
    assert [r[:3] for r in rows] == [["1", "MiB", "1"], ["1", "MiB", "2"]]
    for r in rows:
        # "<time> <unit> (<ratio>x)" for each deepnex peer, then raw TCP's time.
        assert len(r) == 11, r
        for at in (3, 6):
            assert float(r[at]) > 0 and r[at + 1] in ("us", "ms"), r
            assert r[at + 2].startswith("(") and r[at + 2].endswith("x)"), r
            assert float(r[at + 2][1:-2]) > 0, r
        assert float(r[9]) > 0 and r[10] in ("us", "ms"), r
