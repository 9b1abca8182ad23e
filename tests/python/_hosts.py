"""Simulated hosts on this machine, for the tests and benchmarks that cross
hosts (../shared/docs/ENGINES.md, "Several hosts on one machine").

    hosts = Hosts({"h1": 11, "h2": 12})      # h1 = 10.77.0.11, h2 = 10.77.0.12
    hosts.up()
    p = hosts.popen("h1", ["deepnex-ps", "--listen", "10.77.0.11:0"], stdout=PIPE)
    hosts.run("h2", ["hostname"]).stdout     # "h2\\n"
    hosts.partition("h2")                    # or partition("h2", "h1"): h2 from h1 only
    hosts.heal()
    hosts.cap("h2", "1gbit")                 # tc tbf both ways on h2's link
    hosts.down()                             # idempotent; kills what runs there

A host is a network namespace with a veth into a bridge of its own (no
address on the machine's side, so nothing here reaches the machine's network
and two test sessions with the same addresses never meet), an address in
10.77.0.0/24, no default route, and a persistent UTS namespace with its own
hostname. Every command runs there under `STATE/on-<host>`, a wrapper that
enters both namespaces and a private mount namespace in which the host's own
/etc/hosts (every simulated host by name) and an empty /etc/resolv.conf are
bind-mounted; processes still share the machine's files and /dev/shm, as
containers with host IPC would (`private_shm=True` gives one process a tmpfs
/dev/shm of its own). The wrapper execs, so a Popen's pid is the command's.

Names are unique per owner process (`dnx<pid><letter>`), and the state
directory STATE_ROOT/<tag> records what was made before it is made, so
`cleanup_leftovers()` (the fixtures call it once per session) removes
what a killed run left: namespaces, the bridge, the UTS mounts and every
process still inside. The kernel here has no netem: there is no delay or loss
emulation, only partitions (iptables DROP: peers see timeouts, not resets)
and a bandwidth cap (tbf).

Needs root, ip, nsenter, unshare, iptables and tc; `unavailable()` says why
not, and the fixtures skip with that reason.

As a program: `python3 _hosts.py up NAME=OCTET... ` prints the state
directory (then `STATE/on-NAME CMD` runs CMD there), `python3 _hosts.py down
STATE` and `python3 _hosts.py cleanup` (leftovers of dead owners).
"""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

SUBNET = "10.77.0"
STATE_ROOT = "/tmp/deepnex-hosts"
TOOLS = ("ip", "nsenter", "unshare", "iptables", "tc", "mount", "umount", "hostname")
_counter = [0]


def unavailable():
    """Why simulated hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces, iptables, tc)"
    for tool in TOOLS:
        if shutil.which(tool) is None:
            return f"simulated hosts need {tool} (apt-get install iproute2 iptables util-linux)"
    probe = f"dnxprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _start_time(pid):
    """The kernel's start time of pid (clock ticks since boot), or None when
    it is gone: with the pid it names one process, even after pid reuse."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _sh(argv, check=True):
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and r.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} exited {r.returncode}: {r.stderr.strip()}")
    return r


class Hosts:
    """Simulated hosts named by `hosts` ({name: last octet of 10.77.0.x}).

    Not thread-safe: one test (or benchmark) drives its hosts from one thread.
    """

    def __init__(self, hosts, tag=None):
        for name, octet in hosts.items():
            if not name.isidentifier() or len(name) > 12:
                raise ValueError(f"host name {name!r}: letters, digits, _; at most 12")
            if not 1 <= int(octet) <= 254:
                raise ValueError(f"host {name}: octet {octet} outside 1..254")
        if len({int(o) for o in hosts.values()}) != len(hosts):
            raise ValueError(f"hosts {hosts}: two hosts share an address")
        if tag is None:
            # dnx<pid><n in letters>: unique on the machine while this
            # process lives, and short enough for interface names (15).
            _counter[0] += 1
            n, letters = _counter[0], ""
            while n:
                n, r = divmod(n - 1, 26)
                letters = chr(ord("a") + r) + letters
            tag = f"dnx{os.getpid()}{letters}"
        self.tag = tag
        self.hosts = {name: f"{SUBNET}.{int(octet)}" for name, octet in hosts.items()}
        self.dir = os.path.join(STATE_ROOT, tag)
        self.bridge = f"{tag}b"

    # ---- names of what is made

    def netns(self, name):
        return f"{self.tag}-{name}"

    def _veth(self, name):
        return f"{self.tag}{list(self.hosts).index(name)}"

    def address(self, name):
        return self.hosts[name]

    def wrapper(self, name):
        """The program that runs its arguments on host `name`."""
        return os.path.join(self.dir, f"on-{name}")

    # ---- life cycle

    def up(self):
        os.makedirs(STATE_ROOT, exist_ok=True)
        os.makedirs(self.dir)
        # Recorded before anything is made, so a run killed half-way is
        # still cleaned up by the next session.
        with open(os.path.join(self.dir, "state.json"), "w") as f:
            json.dump({"owner": os.getpid(), "owner_start": _start_time(os.getpid()),
                       "bridge": self.bridge, "hosts": self.hosts,
                       "netns": [self.netns(n) for n in self.hosts]}, f)
        try:
            self._make()
        except BaseException:
            self.down()
            raise
        return self

    def _make(self):
        _sh(["ip", "link", "add", self.bridge, "type", "bridge"])
        _sh(["ip", "link", "set", self.bridge, "up"])
        etc_hosts = "127.0.0.1 localhost\n" + "".join(
            f"{addr} {name}\n" for name, addr in self.hosts.items())
        for name, addr in self.hosts.items():
            ns, veth = self.netns(name), self._veth(name)
            _sh(["ip", "netns", "add", ns])
            _sh(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _sh(["ip", "link", "set", veth, "master", self.bridge, "up"])
            _sh(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0"])
            _sh(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            uts = os.path.join(self.dir, f"uts-{name}")
            open(uts, "w").close()
            _sh(["unshare", f"--uts={uts}", "hostname", name])
            hosts_file = os.path.join(self.dir, f"hosts-{name}")
            with open(hosts_file, "w") as f:
                f.write(etc_hosts)
            resolv = os.path.join(self.dir, f"resolv-{name}")
            with open(resolv, "w") as f:
                f.write("# simulated host: names come from /etc/hosts only\n")
            # DEEPNEX_HOST_PRIVATE_SHM=1: a tmpfs /dev/shm for this process
            # alone, as a host (or container) with its own would have.
            script = (
                f"mount --bind {shlex.quote(hosts_file)} /etc/hosts && "
                f"mount --bind {shlex.quote(resolv)} /etc/resolv.conf && "
                'if [ "${DEEPNEX_HOST_PRIVATE_SHM:-0}" = 1 ]; then '
                "mount -t tmpfs -o size=256m tmpfs /dev/shm || exit 125; fi && "
                'unset DEEPNEX_HOST_PRIVATE_SHM && exec "$@"')
            wrapper = self.wrapper(name)
            with open(wrapper, "w") as f:
                f.write("#!/bin/sh\n"
                        f"# Runs its arguments on simulated host {name} ({addr}).\n"
                        f"exec nsenter --net=/run/netns/{ns} --uts={uts} -- "
                        f"unshare --mount -- sh -c {shlex.quote(script)} sh \"$@\"\n")
            os.chmod(wrapper, 0o755)

    def down(self):
        """Kills every process on the hosts and removes them. Idempotent."""
        if os.path.isdir(self.dir):
            _teardown(self.dir)

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()

    # ---- running things

    def command(self, name, argv):
        if name not in self.hosts:
            raise KeyError(f"no simulated host {name!r} (hosts: {', '.join(self.hosts)})")
        return [self.wrapper(name), *[str(a) for a in argv]]

    def popen(self, name, argv, private_shm=False, env=None, **kwargs):
        """subprocess.Popen of argv on host `name` (exec on host)."""
        env = dict(os.environ if env is None else env)
        env["DEEPNEX_HOST_PRIVATE_SHM"] = "1" if private_shm else "0"
        return subprocess.Popen(self.command(name, argv), env=env, **kwargs)

    def run(self, name, argv, timeout=60, check=True, private_shm=False, env=None, **kwargs):
        """subprocess.run of argv on host `name`, text output captured."""
        env = dict(os.environ if env is None else env)
        env["DEEPNEX_HOST_PRIVATE_SHM"] = "1" if private_shm else "0"
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        r = subprocess.run(self.command(name, argv), env=env, timeout=timeout, **kwargs)
        if check and r.returncode != 0:
            raise AssertionError(f"on {name}: {shlex.join(map(str, argv))} exited "
                                 f"{r.returncode}:\n{r.stdout}{r.stderr}")
        return r

    def _in(self, name, argv, check=True):
        return _sh(["nsenter", f"--net=/run/netns/{self.netns(name)}", "--", *argv], check)

    # ---- faults

    def partition(self, name, peer=None):
        """Drops every packet between host `name` and the others (or only
        `peer`), both ways; its own loopback keeps working."""
        if peer is None:
            rules = [["INPUT", "!", "-i", "lo"], ["OUTPUT", "!", "-o", "lo"]]
        else:
            rules = [["INPUT", "-s", self.address(peer)], ["OUTPUT", "-d", self.address(peer)]]
        for rule in rules:
            self._in(name, ["iptables", "-A", *rule, "-j", "DROP"])

    def heal(self, name=None):
        """Removes the partitions of host `name` (of every host without)."""
        for n in [name] if name else list(self.hosts):
            for chain in ("INPUT", "OUTPUT"):
                self._in(n, ["iptables", "-F", chain])

    def cap(self, name, rate):
        """Caps host `name`'s link at `rate` (tc syntax: "1gbit") each way,
        with a token bucket (tbf) on both ends of its veth; rate None
        removes the cap."""
        ns = ["nsenter", f"--net=/run/netns/{self.netns(name)}", "--"]
        for prefix, dev in ((ns, "eth0"), ([], self._veth(name))):
            if rate is None:
                _sh([*prefix, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
                continue
            # A bucket of 10 ms at the rate, at least 256 KiB: veth hands
            # tbf 64 KiB GSO segments, and a bucket smaller than one drops them.
            burst = max(_rate_bits(rate) // 8 // 100, 256 << 10)
            _sh([*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                 "burst", str(burst), "latency", "100ms"])


def _rate_bits(rate):
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bit": 1}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return int(float(rate[:-len(unit)]) * scale)
    raise ValueError(f"rate {rate!r}: expected a number with kbit, mbit or gbit")


def _processes_naming(text):
    """Live processes other than this one whose command line contains text."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(entry))
        except OSError:
            pass
    return pids


def _teardown(state_dir):
    """Removes what the state directory records: processes, namespaces,
    bridge, UTS mounts, then the directory."""
    try:
        with open(os.path.join(state_dir, "state.json")) as f:
            state = json.load(f)
    except (OSError, ValueError):
        state = {"netns": [], "bridge": None}
    # Helpers on the machine's side that belong to these hosts name the
    # directory (tests/launch/slurm.sh keeps its munged and supervisor there).
    for pid in _processes_naming(state_dir + "/"):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for ns in state["netns"]:
        if not os.path.exists(f"/run/netns/{ns}"):
            continue
        # Everything in the namespace was started through the harness.
        for _ in range(50):
            pids = _sh(["ip", "netns", "pids", ns], check=False).stdout.split()
            alive = [int(p) for p in pids if _start_time(int(p)) is not None
                     and int(p) != os.getpid()]
            if not alive:
                break
            for pid in alive:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        _sh(["ip", "netns", "del", ns], check=False)
    if state.get("bridge"):
        _sh(["ip", "link", "del", state["bridge"]], check=False)
    for entry in os.listdir(state_dir):
        if entry.startswith("uts-"):
            _sh(["umount", os.path.join(state_dir, entry)], check=False)
    shutil.rmtree(state_dir, ignore_errors=True)


def cleanup_leftovers():
    """Tears down the hosts of owners that are gone (a killed test run);
    those of live sessions are left alone."""
    if not os.path.isdir(STATE_ROOT):
        return []
    removed = []
    for tag in os.listdir(STATE_ROOT):
        state_dir = os.path.join(STATE_ROOT, tag)
        try:
            with open(os.path.join(state_dir, "state.json")) as f:
                state = json.load(f)
            alive = _start_time(state["owner"]) == state["owner_start"]
        except (OSError, ValueError, KeyError):
            # No state yet: a session between makedirs and its first write,
            # or one killed there; only the latter is old.
            alive = time.time() - os.path.getmtime(state_dir) < 60
        if not alive:
            _teardown(state_dir)
            removed.append(tag)
    return removed


def main(argv):
    if len(argv) >= 2 and argv[0] == "up":
        hosts = Hosts({k: int(v) for k, v in (a.split("=", 1) for a in argv[1:])})
        hosts.up()
        # Owned by nobody alive once this program exits: mark it as owned by
        # its parent shell, whose end makes it a leftover.
        state_file = os.path.join(hosts.dir, "state.json")
        with open(state_file) as f:
            state = json.load(f)
        state.update(owner=os.getppid(), owner_start=_start_time(os.getppid()))
        with open(state_file, "w") as f:
            json.dump(state, f)
        print(hosts.dir)
        return 0
    if len(argv) == 2 and argv[0] == "down":
        _teardown(os.path.abspath(argv[1]))
        return 0
    if argv == ["cleanup"]:
        for tag in cleanup_leftovers():
            print(f"removed leftover simulated hosts {tag}")
        return 0
    print("usage: _hosts.py up NAME=OCTET... | down STATE_DIR | cleanup", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
