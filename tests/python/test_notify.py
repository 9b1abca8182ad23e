"""deepnex-central's webhook notifications, end to end: a receiver in the
test (http.server on 127.0.0.1) gets a job's events at its `deepnex run
--notify URL` and its user's default URL, in order and signed with the
user's secret; node events as agents go NotReady and come back, signed with
the admin's; and none is lost across a central kill -9 while the receiver is
down. Bad --notify values are named."""

import hashlib
import hmac
import http.server
import json
import os
import socket
import subprocess
import threading

import pytest

from deepnex import gpu

import _central
from _central import CENTRAL_BIN, TOKENS, stop_central
from _wait import wait_for
from _agents import AGENT_BIN, NODE_TOKENS, Agents

SECRETS = "admin adminsecret\nalice alicesecret\n"


def signature(secret, body):
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


class Receiver:
    """An HTTP server on 127.0.0.1 that records every POST (headers, raw
    body, parsed event) and answers 200. Bound at once; connections are
    refused until listen()."""

    def __init__(self, listen=True):
        received = self.received = []
        lock = self.lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with lock:
                    received.append((dict(self.headers), body, json.loads(body)))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.HTTPServer(("127.0.0.1", 0), Handler,
                                             bind_and_activate=False)
        self.server.server_bind()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = None
        if listen:
            self.listen()

    def listen(self):
        self.server.server_activate()
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def events(self):
        with self.lock:
            return list(self.received)

    def close(self):
        if self.thread is not None:
            self.server.shutdown()
            self.thread.join(timeout=10)
        self.server.server_close()


class Central:
    """deepnex-central with agents' node tokens, --node-timeout 2 and the
    given notify flags; its stderr lines collected as they come."""

    def __init__(self, tmp_path, *notify):
        if not os.path.exists(AGENT_BIN):
            pytest.skip(f"{AGENT_BIN} not built")
        tokens = tmp_path / "tokens"
        tokens.write_text(TOKENS + NODE_TOKENS)
        secrets = tmp_path / "secrets"
        secrets.write_text(SECRETS)
        self.proc = subprocess.Popen(
            [os.path.abspath(CENTRAL_BIN), "--listen", "127.0.0.1:0", "--token-file", str(tokens),
             "--node-timeout", "2", "--state-dir", str(tmp_path / "state"),
             "--launch-state-dir", str(tmp_path / "launch"),
             "--notify-secret-file", str(secrets), *notify],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line.startswith("deepnex-central listening on "), line + self.proc.stderr.read()
        self.address = line.split()[3]
        self.lines = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)

    def kill9(self):
        self.proc.kill()
        self.proc.wait()
        self.reader.join(timeout=10)

    def close(self):
        stop_central(self.proc)
        self.reader.join(timeout=10)
        self.proc.stdout.close()
        self.proc.stderr.close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def agents(tmp_path):
    """test_agent's Agents; start(central, node) waits for its registration."""
    a = Agents(tmp_path, None)
    plain_start = a.start

    def start(central, node):
        a.central = central.address
        d = plain_start(node, f"{node}tok")
        a.registered(d, node)
        return d

    a.start = start
    yield a
    a.close()


def start_then_kill(agents, central, *nodes):
    """Registers an agent of each of `nodes` with central, then kills them."""
    for node in nodes:
        agents.start(central, node)
    for d in agents.daemons:
        d.kill()


def distinct_node_events(receiver, node):
    """node_events, deduplicated by id as a receiver does: central killed
    right after a Publish may send that event again, with its id."""
    by_id = {}
    for kind, e in node_events(receiver, node):
        by_id.setdefault(e["id"], (kind, e))
    return list(by_id.values())


def node_events(receiver, node):
    return [(e["kind"], e) for _, _, e in receiver.events() if e["node"] == node]


def test_job_events_reach_the_jobs_and_its_users_urls_in_order(tmp_path, receiver):
    from test_job import RunningJob
    defaults = Receiver()
    secrets = tmp_path / "secrets"
    secrets.write_text(SECRETS)
    # The receivers listen on 127.0.0.1, where a job's own URL may not reach
    # unless central allows it.
    proc, address = _central.start_central(
        tmp_path, "--state-dir", str(tmp_path / "state"), "--notify", f"alice={defaults.url}",
        "--notify-secret-file", str(secrets), "--notify-allow-private", cpus=8,
        memory="16GiB", node=socket.gethostname())
    try:
        env = {k: v for k, v in os.environ.items() if k != "DEEPNEX_TOKEN"}
        env.update(DEEPNEX_CENTRAL=address, DEEPNEX_TOKEN="alicetok")
        j = RunningJob(tmp_path, ["--mode", "allreduce", "--memory", "64MiB",
                                  "--restart", "on-failure:1", "--notify", receiver.url],
                       ["sh", "-c", "exit 3"], env=env)
        assert j.wait(120) != 0, j.output()
        kinds = ["job.queued", "job.started", "job.worker_restarted", "job.failed"]
        for r in (receiver, defaults):
            wait_for(lambda: len(r.events()) == len(kinds), "the job's 4 events", timeout=30)
            assert [e["kind"] for _, _, e in r.events()] == kinds
            for headers, body, event in r.events():
                assert headers["X-Deepnex-Signature"] == signature("alicesecret", body)
                assert headers["X-Deepnex-Signature"] != signature("adminsecret", body)
                assert (event["user"], event["job"]) == ("alice", j.name)
            failed = r.events()[-1][2]["data"]
            assert (failed["state"], failed["exit_code"], failed["restarts"]) == ("failed", 3, 1)
        # One event, one id, the same at both URLs.
        assert [e["id"] for _, _, e in receiver.events()] == \
            [e["id"] for _, _, e in defaults.events()]
        # Counted on the admins' metrics, to alert on receivers that fail.
        # A delivery counts once central has read the receiver's answer,
        # which comes after the receiver recorded the POST: waited for.
        admin = gpu.CentralClient(address, token="admintok", timeout=10)
        delivered = 'deepnex_notify_deliveries_total{outcome="delivered"} 8\n'

        def counted():
            m = admin.metrics()
            return m if delivered in m else None
        metrics = wait_for(counted, lambda: "8 deliveries counted:\n" + admin.metrics(),
                           timeout=30)
        for series in ('deepnex_notify_deliveries_total{outcome="published"} 8',
                       'deepnex_notify_deliveries_total{outcome="delivered"} 8',
                       'deepnex_notify_deliveries_total{outcome="dropped"} 0',
                       "deepnex_notify_pending 0"):
            assert series + "\n" in metrics, metrics
    finally:
        stop_central(proc)
        defaults.close()


def test_an_event_durable_but_not_published_goes_out_after_a_restart(tmp_path, receiver,
                                                                      monkeypatch):
    """Central dies (the test hook's _exit) after the job's completion is in
    its record and before its Publish; the restarted central publishes it,
    with the id it would have had, after the job's earlier events."""
    from test_job import RunningJob
    secrets = tmp_path / "secrets"
    secrets.write_text(SECRETS)
    flags = ["--state-dir", str(tmp_path / "state"), "--notify-secret-file", str(secrets),
             "--notify-allow-private"]
    monkeypatch.setenv("DEEPNEX_TEST_EXIT_BEFORE_PUBLISH", "completed")
    proc, address = _central.start_central(tmp_path, *flags, cpus=8, memory="16GiB",
                                           node=socket.gethostname())
    monkeypatch.delenv("DEEPNEX_TEST_EXIT_BEFORE_PUBLISH")
    j = None
    try:
        env = {k: v for k, v in os.environ.items() if k != "DEEPNEX_TOKEN"}
        env.update(DEEPNEX_CENTRAL=address, DEEPNEX_TOKEN="alicetok")
        j = RunningJob(tmp_path, ["--mode", "allreduce", "--memory", "64MiB",
                                  "--notify", receiver.url], ["true"],
                       env=env)
        # The runner's report of the job's end is what makes central exit.
        assert proc.wait(timeout=120) == 86, proc.stderr.read() + j.output()
    finally:
        stop_central(proc)
        if j is not None:
            j.proc.kill()
            j.proc.wait()
    # A restart that fails (here: its port is taken) says so and exits. It
    # hung for ever, deaf to SIGTERM: the job store's thread was publishing
    # the recovered event to a notifier that opens only once central starts.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        r = subprocess.run([CENTRAL_BIN, "--listen", address, *flags], capture_output=True,
                           text=True, timeout=60)
    assert (r.returncode, r.stderr) == (1, f'deepnex-central: central server: cannot listen on '
                                           f'"{address}": Address already in use\n')
    proc, _ = _central.start_central(tmp_path, *flags, cpus=8, memory="16GiB",
                                     node=socket.gethostname())
    try:
        wait_for(lambda: any(e["kind"] == "job.completed" for _, _, e in receiver.events()),
                 "job.completed after the restart", timeout=30)
    finally:
        stop_central(proc)
    # As a receiver does: deduplicated by id. An event published before the
    # exit may come again (its record as sent may not have reached the disk):
    # the same id and kind, made anew from the job's record. Events of a job
    # come in order, so the first delivery of each is in order.
    by_id = {}
    for headers, body, event in receiver.events():
        assert headers["X-Deepnex-Signature"] == signature("alicesecret", body)
        assert headers["X-Deepnex-Event-Id"] == event["id"]
        assert by_id.setdefault(event["id"], event)["kind"] == event["kind"]
    events = list(by_id.values())
    run = events[0]["id"].split("/")[1]
    assert [(e["id"], e["kind"]) for e in events] == [
        (f"{j.name}/{run}/{n}", kind)
        for n, kind in enumerate(["job.queued", "job.started", "job.completed"], 1)]
    assert (events[2]["data"]["state"], events[2]["data"]["exit_code"]) == ("completed", 0)


def test_a_jobs_url_to_a_loopback_or_private_address_is_refused(tmp_path, receiver):
    """A hostile user's `deepnex run --notify` would make central POST to
    the services beside it (a receiver on 127.0.0.1 stands for them, as
    169.254.169.254 for a cloud's metadata): central refuses the job, and
    its admin's own URLs and --notify-allow-private are what may go there.
    The URL the admin gave alice's events takes bob's job there no more:
    bob's events went to it."""
    from test_job import RunningJob
    alices = "http://127.0.0.1:9/alices"
    proc, address = _central.start_central(tmp_path, "--notify", f"alice={alices}", cpus=8,
                                           memory="16GiB", node=socket.gethostname())
    try:
        env = {k: v for k, v in os.environ.items() if k != "DEEPNEX_TOKEN"}
        env.update(DEEPNEX_CENTRAL=address)
        for token, url, address_is in [("alicetok", receiver.url, "127.0.0.1 is a loopback address"),
                                       ("alicetok", "http://169.254.169.254/latest/meta-data/",
                                        "169.254.169.254 is a link-local address"),
                                       ("bobtok", alices, "127.0.0.1 is a loopback address")]:
            env.update(DEEPNEX_TOKEN=token)
            j = RunningJob(tmp_path, ["--mode", "allreduce", "--memory", "64MiB",
                                      "--notify", url], ["true"], env=env)
            assert j.wait(120) != 0, j.output()
            assert (f'notify URL "{url}": {address_is}; deepnex-central posts a job\'s own '
                    "webhooks only to public addresses") in j.output()
        assert receiver.events() == []
        # Refused before it ran: central has no such job.
        assert [c.jobs(all=True) for c in _central.clients(address)] == [[], []]
    finally:
        stop_central(proc)


@pytest.mark.parametrize("args, message", [
    (["--central", "127.0.0.1:1", "--notify", "ftp://x/y"],
     'notify: URL "ftp://x/y" is not http://HOST[:PORT][/PATH]'),
    (["--notify", "http://127.0.0.1:9/hook"],
     'notify: "http://127.0.0.1:9/hook" needs central (deepnex-central sends them)'),
    # A probe's 2000 made 6000 POSTs of one job's 3 events.
    (["--central", "127.0.0.1:1"] + ["--notify", "https://hooks.example.com/x"] * 9,
     "notify: 9 URLs; at most 8"),
])
def test_a_bad_notify_url_of_a_job_is_named(tmp_path, args, message):
    from test_job import RunningJob
    env = {k: v for k, v in os.environ.items() if k != "DEEPNEX_CENTRAL"}
    j = RunningJob(tmp_path, ["--memory", "64MiB", *args], ["true"], env=env)
    assert j.wait(60) == 2, j.output()
    assert message in j.output()


def test_node_events_reach_admins_signed(tmp_path, receiver, agents):
    central = Central(tmp_path, "--notify-admin", receiver.url)
    try:
        h1 = agents.start(central, "h1")
        h1.kill()
        wait_for(lambda: [k for k, _ in node_events(receiver, "h1")] == ["node.not_ready"],
                 "node.not_ready of h1", timeout=30)
        agents.start(central, "h1")
        wait_for(lambda: [k for k, _ in node_events(receiver, "h1")] ==
                 ["node.not_ready", "node.ready"], "node.ready of h1", timeout=30)
        for headers, body, event in receiver.events():
            assert headers["X-Deepnex-Signature"] == signature("adminsecret", body)
            assert headers["X-Deepnex-Signature"] != signature("alicesecret", body)
            assert headers["X-Deepnex-Event-Id"] == event["id"]
            assert event["user"] == "" and event["job"] == ""
        not_ready = node_events(receiver, "h1")[0][1]
        assert not_ready["data"]["reason"].startswith("no heartbeat for ")
        assert node_events(receiver, "h1")[1][1]["data"] == {"reason": "its agent registered again"}
    finally:
        central.close()


def test_node_events_across_a_central_restart_tell_only_changes(tmp_path, receiver, agents):
    """h1 goes NotReady and stays down across a central restart: no second
    node.not_ready. h2 goes NotReady and comes back while central is down:
    node.ready once the restarted central hears it. Event ids are
    node/NODE/SEQ."""
    central = Central(tmp_path, "--notify-admin", receiver.url)
    try:
        start_then_kill(agents, central, "h1", "h2")
        for node in ("h1", "h2"):
            wait_for(lambda: [k for k, _ in node_events(receiver, node)] == ["node.not_ready"],
                     f"node.not_ready of {node}", timeout=30)
        # Recorded just after each Publish: a kill before would tell it again.
        told = tmp_path / "state" / "notify-nodes"
        wait_for(lambda: told.exists() and sorted(told.read_text().splitlines()) ==
                 ["h1 not_ready 1", "h2 not_ready 1"], "what the admins were told, on disk")
        central.kill9()
    finally:
        central.close()
    central = Central(tmp_path, "--notify-admin", receiver.url)
    try:
        agents.start(central, "h2")
        wait_for(lambda: [k for k, _ in distinct_node_events(receiver, "h2")] ==
                 ["node.not_ready", "node.ready"], "node.ready of h2", timeout=30)
        # The restarted central finds h1 NotReady again; it tells nobody.
        wait_for(lambda: any("node h1 is NotReady" in line for line in central.lines),
                 "h1 NotReady in the restarted central", timeout=30)
        agents.start(central, "h1")
        # One job (node) at a time, in order: a repeated node.not_ready
        # would have come before this node.ready.
        wait_for(lambda: len(distinct_node_events(receiver, "h1")) >= 2, "node.ready of h1",
                 timeout=30)
    finally:
        central.close()
    for node in ("h1", "h2"):
        assert [(e["id"], k) for k, e in distinct_node_events(receiver, node)] == [
            (f"node/{node}/1", "node.not_ready"), (f"node/{node}/2", "node.ready")]
    assert distinct_node_events(receiver, "h2")[1][1]["data"] == \
        {"reason": "its agent registered again"}


def test_no_event_lost_across_central_kill_9(tmp_path, agents):
    receiver = Receiver(listen=False)  # refuses connections for now
    try:
        central = Central(tmp_path, "--notify-admin", receiver.url)
        try:
            start_then_kill(agents, central, "h1", "h2")
            # A failed attempt means the event was in the outbox (fsync'd) first.
            def retried_ids():
                return {line.split()[2] for line in central.lines
                        if line.startswith("notify: event ") and "; retry" in line}
            wait_for(lambda: len(retried_ids()) == 2, "attempts at both nodes' events",
                     timeout=30)
            retried = retried_ids()
            central.kill9()
        finally:
            central.close()
        receiver.listen()
        central = Central(tmp_path, "--notify-admin", receiver.url)
        try:
            wait_for(lambda: retried <= {e["id"] for _, _, e in receiver.events()},
                     "the events from before the kill", timeout=30)
            wait_for(lambda: any(line.startswith("notify: 2 undelivered event(s) in the outbox")
                                 for line in central.lines), "the outbox's log line")
        finally:
            central.close()
        by_id = {}
        for headers, body, event in receiver.events():
            assert headers["X-Deepnex-Signature"] == signature("adminsecret", body)
            # Duplicates only as the same event again.
            assert by_id.setdefault(event["id"], body) == body
        assert sorted(e["node"] for _, _, e in receiver.events() if e["id"] in retried) == \
            ["h1", "h2"]
    finally:
        receiver.close()


@pytest.mark.parametrize("flags, message", [
    (["--notify", "alice"], '--notify "alice" is not USER=URL'),
    (["--notify", "alice=ftp://x/y"], '--notify "alice=ftp://x/y": URL "ftp://x/y" is not '
                                      'http://HOST[:PORT][/PATH]'),
    (["--notify-admin", "http://127.0.0.1:0x/"], "--notify-admin URL \"http://127.0.0.1:0x/\""),
])
def test_bad_notify_flags_are_named(flags, message):
    if not os.path.exists(CENTRAL_BIN):
        pytest.skip(f"{CENTRAL_BIN} not built")
    out = subprocess.run([CENTRAL_BIN, *flags], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert message in out.stderr


def test_bad_secret_file_line_is_named(tmp_path):
    if not os.path.exists(CENTRAL_BIN):
        pytest.skip(f"{CENTRAL_BIN} not built")
    secrets = tmp_path / "secrets"
    secrets.write_text("admin adminsecret\nalice\n")
    out = subprocess.run([CENTRAL_BIN, "--notify-secret-file", str(secrets)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert (f"--notify-secret-file: notify secret file {secrets} line 2: "
            "expected \"USER SECRET\", got 1 fields") in out.stderr
    assert "adminsecret" not in out.stderr
