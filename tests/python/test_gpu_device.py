"""deepnex on a real GPU: what only a CUDA device and the NVIDIA driver show.

The rest of the suite runs NVML as a fake and CUDA not at all. Here the
real driver answers: discovery against what CUDA itself reports, the
shared-mode memory limit in PyTorch's allocator, a process container's
device rules and its GPU memory as NVML sees it, an agent's node and usage,
and CUDA tensors through the nccl communicator, DistributedDataParallel and
the parameter server. Every test skips without a CUDA device (torch sees
none); benchmarks/gpu_check.sh runs them where there is one."""

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

import deepnex  # noqa: E402
import deepnex.torch as dtorch  # noqa: E402
from _agents import AGENT_BIN, Agents, Daemon, client, start_central  # noqa: E402
from _wait import wait_for  # noqa: E402
from deepnex import collective, gpu, launch  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: these tests need a GPU")

GiB = 1 << 30

# Takes 1 GiB on GPU 0, says "holding", and holds it until killed.
HOLD = textwrap.dedent("""
    import time, torch
    x = torch.ones(1 << 28, device="cuda")  # 1 GiB of float32
    torch.cuda.synchronize()
    print("holding", flush=True)
    time.sleep(600)
""")


def cuda_devices():
    """uuid -> torch's properties of each visible device."""
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return {f"GPU-{p.uuid}": p for p in props}


def test_discovery_finds_the_gpus_cuda_sees():
    found = gpu.discover()
    cuda = cuda_devices()
    n = len(cuda)
    assert found["summary"].startswith(f"{n} GPU{'s' if n > 1 else ''} (NVML"), found["summary"]
    assert found["driver_version"]
    assert {g["uuid"] for g in found["gpus"]} == set(cuda)
    for i, g in enumerate(found["gpus"]):
        p = cuda[g["uuid"]]
        assert g["index"] == i
        assert g["name"] == p.name
        # "0000:18:00.0" from NVML names the PCI bus CUDA reports.
        assert int(g["pci_bus_id"].split(":")[-2], 16) == p.pci_bus_id, g["pci_bus_id"]
        # NVML counts all of the memory; CUDA leaves out what the driver keeps.
        assert p.total_memory <= g["memory"] <= p.total_memory * 1.05, (g["memory"], p)
    assert [row[i] for i, row in enumerate(found["links"])] == ["self"] * n
    node = gpu.local_node("here")
    assert [(g.uuid, g.memory) for g in node.gpus] == [(g["uuid"], g["memory"])
                                                      for g in found["gpus"]]


def test_a_shared_grant_caps_pytorch_through_init(tmp_path):
    script = textwrap.dedent("""
        import logging, torch, deepnex
        logging.basicConfig(level=logging.INFO)
        deepnex.init()
        a = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
        try:
            torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
            print("granted past the limit")
        except torch.OutOfMemoryError:
            print("refused past the limit")
    """)
    env = dict(os.environ, DEEPNEX_JOB_ID="j", DEEPNEX_ROLE="worker", DEEPNEX_RANK="0",
               DEEPNEX_WORLD_SIZE="1", DEEPNEX_GPU_MEMORY_LIMIT="1GiB")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "refused past the limit\n"
    assert "PyTorch (memory fraction" in out.stderr


@pytest.fixture
def launcher(tmp_path):
    with launch.Launcher("process", state_dir=str(tmp_path / "state")) as l:
        yield l


def grant(gpus):
    alloc = gpu.Allocator()
    alloc.add_node(gpu.local_node("here"))
    return alloc.allocate(gpu.Request(user="alice", gpus=gpus, cpus=1, memory="8GiB"))


def test_a_process_container_uses_its_granted_gpu_and_reports_its_memory(launcher):
    a = grant(1)
    h = launcher.start(launch.ContainerSpec(name="holder", command=[sys.executable, "-c", HOLD],
                                            cpus=1, memory="8GiB", allocation=a))
    try:
        wait_for(lambda: "holding" in h.logs() or h.status().state != "running",
                 lambda: f"the container's GPU memory; logs: {h.logs()!r}", timeout=120)
        assert h.logs() == "holding\n"
        index = a.gpus[0].index
        usage = wait_for(lambda: h.usage().gpu_memory.get(index, 0) >= GiB and h.usage(),
                         lambda: f"NVML's figure for the container: {h.usage()}")
        assert set(usage.gpu_memory) == {index}
    finally:
        h.stop(grace=1)


def test_a_process_container_granted_no_gpu_cannot_open_one(launcher):
    nodes = sorted(n for n in os.listdir("/dev") if n.startswith("nvidia") and n[6:].isdigit())
    assert nodes
    script = textwrap.dedent(f"""
        import os
        print(open("/proc/self/cgroup").read().count("/deepnex/"), "cgroups")
        for n in {nodes!r}:
            try:
                os.close(os.open("/dev/" + n, os.O_RDWR))
                print(n, "opened")
            except PermissionError:
                print(n, "denied")
    """)
    h = launcher.start(launch.ContainerSpec(name="nogpu", command=[sys.executable, "-c", script],
                                            cpus=1, memory="1GiB", allocation=grant(0)))
    assert h.wait(timeout=60).ok, h.logs()
    cgroups, *opens = h.logs().splitlines()
    if cgroups == "0 cgroups":
        pytest.skip("the process backend makes no cgroups here (not root, or this process's "
                    "cgroup delegates no controllers): nothing restricts device nodes")
    assert opens == [f"{n} denied" for n in nodes]


def test_an_agent_offers_the_gpus_nvml_finds_and_reports_their_use(tmp_path):
    central, address = start_central(tmp_path)
    agents = Agents(tmp_path, address)
    holder = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "holding\n"
        d = Daemon([AGENT_BIN, "--central", address, "--node", "h1", "--token", "h1tok",
                    "--cpus", "2", "--memory", "4GiB", "--state-dir", tmp_path / "h1"],
                   tmp_path / "logs" / "agent-h1", None)
        agents.daemons.append(d)
        agents.registered(d, "h1")
        admin = client(address, "admintok")
        [node] = admin.nodes()
        assert {g["uuid"] for g in node.gpus} == set(cuda_devices())
        wait_for(lambda: any(u["memory_used"] >= GiB for u in admin.nodes()[0].gpu_usage),
                 lambda: f"the agent's GPU usage: {admin.nodes()[0].gpu_usage}")
    finally:
        holder.kill()
        holder.wait(timeout=60)
        agents.close()
        central.kill()


def test_cuda_tensors_go_through_nccl_exactly(store):
    comm = collective.Communicator(0, 1, store=store.address, prefix="cuda1", backend="nccl")
    x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    comm.allreduce(x)
    assert torch.equal(x, torch.arange(1 << 20, dtype=torch.float32, device="cuda"))
    assert torch.equal(comm.allgather(x), x.reshape(1, -1))
    with pytest.raises(deepnex.InvalidArgumentError):
        comm.allreduce(torch.ones(4, device="cuda", dtype=torch.float32)[::2])


def test_ddp_and_the_parameter_server_train_a_cuda_model_exactly(store):
    def model():
        m = torch.nn.Linear(4, 1, bias=False).cuda()
        with torch.no_grad():
            m.weight.copy_(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
        return m

    x = torch.tensor([[1.0, 1.0, 2.0, 2.0]], device="cuda")
    comm = collective.Communicator(0, 1, store=store.address, prefix="ddp1")
    m = model()
    dtorch.DistributedDataParallel(m, communicator=comm)(x).sum().backward()
    assert m.weight.grad.device.type == "cuda"
    assert m.weight.grad.tolist() == [[1.0, 1.0, 2.0, 2.0]]

    with deepnex.ps.Server(mode="sync", num_workers=1,
                           optimizer=deepnex.ps.SGD(lr=0.5)) as server:
        m = model()
        c = deepnex.ps.Client([server.address], worker_id=0)
        opt = dtorch.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=99.0),
                                          named_parameters=m.named_parameters(), client=c)
        for _ in range(2):
            opt.zero_grad()
            m(x).sum().backward()
            opt.step()
        c.close()
    assert m.weight.device.type == "cuda"
    assert m.weight.tolist() == [[0.0, 1.0, 1.0, 2.0]]
