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


def test_plot_draws_scaling_launch_bench_and_allreduce_bench_csvs(tmp_path):
    pytest.importorskip("matplotlib")
    sys.path.insert(0, BENCH)
    try:
        import plot
    finally:
        sys.path.pop(0)
    csvs = {
        "scaling.csv": "workers,model,mode,samples_per_s,time_to_target_s,final_accuracy,"
                       "speedup,job_s\n1,numpy,sync,11840,0.12,0.93,1.0,10.2\n"
                       "2,numpy,sync,5068,,0.89,0.43,16.3\n",
        "launch.csv": "backend,round,start_to_running_ms,start_to_exit_ms\n"
                      "process,0,100.4,134.7\nprocess,1,121.4,278.2\noci,0,440,680\n",
        "allreduce.csv": "size_bytes,shm_busbw_gbps,tcp_busbw_gbps\n4096,0.01,0.02\n"
                         "1048576,1.2,1.3\n",
    }
    for name, text in csvs.items():
        (tmp_path / name).write_text(text)
    series, labels = plot.series_of(plot.read_csv(tmp_path / "allreduce.csv"))
    assert series["shm_busbw_gbps"] == [(4096.0, 0.01), (1048576.0, 1.2)]
    assert labels == ("size_bytes", "GB/s")
    assert plot.scaling_series(plot.read_csv(tmp_path / "scaling.csv"), "time_to_target_s") == {
        "numpy sync": [(1.0, 0.12), (2.0, None)]}
    out = tmp_path / "png"
    assert plot.main([str(tmp_path / n) for n in csvs] + ["--out", str(out)]) == 0
    for name in csvs:
        png = out / name.replace(".csv", ".png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
