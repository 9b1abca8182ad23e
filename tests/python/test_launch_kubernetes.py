"""deepnex.launch's kubernetes backend against an API server played by the
test (no kube-apiserver is packaged here): an HTTP server on 127.0.0.1 that
checks paths, verbs and the bearer token, validates every manifest it gets
against the Kubernetes models of python3-kubernetes, and runs pods through
Pending -> Running -> Succeeded/Failed as each test scripts them."""

import base64
import contextlib
import json
import os
import re
import shutil
import socket
import ssl
import sys
import subprocess
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import deepnex
from _wait import wait_for
from deepnex import launch

kubernetes = pytest.importorskip("kubernetes", reason="python3-kubernetes validates the manifests")

TOKEN = "t0ken"
MiB = 1 << 20

# ---------------------------------------------------------------------------
# Offline manifest validation against the Kubernetes models.

_PRIMITIVES = {"str": str, "int": int, "bool": bool, "float": (int, float)}


def build_model(value, type_name, where):
    """`value` (parsed JSON) as the python3-kubernetes model `type_name`.

    Walks each model's openapi_types and attribute_map, so that a field the
    model does not have fails (the models' own deserializer drops it
    silently); constructing the model fails on a missing required field.
    """
    if type_name in _PRIMITIVES:
        ok = isinstance(value, _PRIMITIVES[type_name]) and not (
            type_name != "bool" and isinstance(value, bool))
        assert ok, f"{where}: expected {type_name}, got {value!r}"
        return value
    if type_name in ("object", "datetime", "date"):
        return value
    if type_name.startswith("list["):
        assert isinstance(value, list), f"{where}: expected a list, got {value!r}"
        inner = type_name[5:-1]
        return [build_model(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if type_name.startswith("dict("):
        assert isinstance(value, dict), f"{where}: expected an object, got {value!r}"
        inner = type_name[5:-1].split(", ", 1)[1]
        return {k: build_model(v, inner, f"{where}.{k}") for k, v in value.items()}
    cls = getattr(kubernetes.client, type_name)
    assert isinstance(value, dict), f"{where}: expected a {type_name} object, got {value!r}"
    by_json = {v: k for k, v in cls.attribute_map.items()}
    unknown = sorted(set(value) - set(by_json))
    assert not unknown, f"{where}: {type_name} has no field {unknown}"
    kwargs = {by_json[k]: build_model(v, cls.openapi_types[by_json[k]], f"{where}.{k}")
              for k, v in value.items()}
    try:
        return cls(**kwargs)
    except ValueError as e:  # a required field is missing
        raise AssertionError(f"{where}: {e}") from None


def test_validator_rejects_unknown_and_missing_fields():
    good = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "main", "image": "busybox"}]}}
    build_model(good, "V1Pod", "pod")
    with pytest.raises(AssertionError, match=r"pod.spec.containers\[0\]: V1Container has no field \['imagee'\]"):
        build_model({**good, "spec": {"containers": [{"name": "main", "imagee": "x"}]}},
                    "V1Pod", "pod")
    with pytest.raises(AssertionError, match="must not be `None`"):
        build_model({**good, "spec": {"containers": [{"image": "busybox"}]}}, "V1Pod", "pod")
    with pytest.raises(AssertionError, match="expected int"):
        build_model({"backoffLimit": "0", "template": {}}, "V1JobSpec", "job.spec")


# ---------------------------------------------------------------------------
# The fake API server.

def selector_matches(selector, labels):
    for term in filter(None, (selector or "").split(",")):
        if term.startswith("!"):
            if term[1:] in labels:
                return False
        elif "=" in term:
            k, v = term.split("=", 1)
            if labels.get(k) != v:
                return False
        elif term not in labels:
            return False
    return True


class Outcome:
    """How a scripted pod ends: after `running_polls` GETs in Running, with
    `exit_code` and `reason` (None: it runs until deleted); `phase_only`:
    the pod fails without a container status (eviction)."""

    def __init__(self, exit_code=0, reason=None, logs="", running_polls=1, forever=False,
                 phase_only=None):
        self.exit_code = exit_code
        self.reason = reason or ("Completed" if exit_code == 0 else "Error")
        self.logs = logs
        self.running_polls = running_polls
        self.forever = forever
        self.phase_only = phase_only


class FakeApiServer:
    def __init__(self, tls_cert=None, tls_key=None, client_ca=None):
        self.lock = threading.Lock()
        self.pods = {}       # (namespace, name) -> pod
        self.jobs = {}       # (namespace, name) -> job
        self.polls = {}      # (namespace, pod name) -> GETs so far
        self.outcomes = {}   # pod name (a job's: the job's name) -> Outcome
        self.requests = []   # (method, path, query, body)
        self.errors = []     # what the server refused; a test fails on any
        # [method, path part, HTTP code, times(, options)]: the next calls
        # fail; options: "done": the call is done first and only its answer
        # is the error (a proxy's 504 after the server acted), "retry_after":
        # the Retry-After header sent with it.
        self.faults = []
        self.pods_at_post = {}  # pod name -> the pods there when it was POSTed
        server = self
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), type(
            "Handler", (_Handler,), {"api": server}))
        self.scheme = "http"
        if tls_cert:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(tls_cert, tls_key)
            if client_ca:
                # A client certificate signed by client_ca authenticates.
                ctx.verify_mode = ssl.CERT_REQUIRED
                ctx.load_verify_locations(client_ca)
            self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
            self.scheme = "https"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self):
        return f"{self.scheme}://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)

    def wait_removed(self, timeout=60):
        """Until each pod and job created was deleted the way Run::Remove does."""
        deadline = time.time() + timeout
        while True:
            with self.lock:
                made = {(r[1].rsplit("/", 1)[1], r[3]["metadata"]["name"]) for r in self.requests
                        if r[0] == "POST" and r[3]}
                gone = {tuple(r[1].rsplit("/", 2)[1:]) for r in self.requests
                        if r[0] == "DELETE" and (r[2].get("gracePeriodSeconds") == "0" or
                                                 r[2].get("propagationPolicy") == "Background")}
            if made <= gone:
                return
            assert time.time() < deadline, f"not removed: {made - gone}"
            time.sleep(0.05)

    def sent(self, method, path_part=""):
        with self.lock:
            return [r for r in self.requests if r[0] == method and path_part in r[1]]

    # -- object lifecycle --------------------------------------------------

    def add_pod(self, namespace, pod, owner_job=None):
        meta = pod["metadata"]
        meta.setdefault("namespace", namespace)
        meta["uid"] = f"uid-{meta['name']}"
        if owner_job:
            meta.setdefault("labels", {})["job-name"] = owner_job
            meta["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job",
                                        "name": owner_job, "uid": f"uid-{owner_job}"}]
        pod["status"] = {"phase": "Pending", "containerStatuses": [{
            "name": "main", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
            "state": {"waiting": {"reason": "ContainerCreating"}}}]}
        self.pods[(namespace, meta["name"])] = pod

    def advance(self, namespace, name):
        """One GET's worth of progress for the pod."""
        pod = self.pods[(namespace, name)]
        n = self.polls.get((namespace, name), 0) + 1
        self.polls[(namespace, name)] = n
        job = pod["metadata"].get("labels", {}).get("job-name")
        outcome = self.outcomes.get(job or name) or Outcome()
        status = pod["status"]
        if n == 1:
            return  # still Pending
        if outcome.phase_only:
            status["phase"] = outcome.phase_only
            status["reason"] = "Evicted"
            status.pop("containerStatuses", None)
        elif outcome.forever or n <= 1 + outcome.running_polls:
            status["phase"] = "Running"
            status["containerStatuses"][0]["state"] = {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
        else:
            status["phase"] = "Succeeded" if outcome.exit_code == 0 else "Failed"
            status["containerStatuses"][0]["state"] = {"terminated": {
                "exitCode": outcome.exit_code, "reason": outcome.reason}}
        if job and (self.namespace_job(namespace, job)) and status["phase"] in ("Succeeded", "Failed"):
            self.namespace_job(namespace, job)["status"] = {"conditions": [{
                "type": "Complete" if status["phase"] == "Succeeded" else "Failed",
                "status": "True"}]}

    def namespace_job(self, namespace, name):
        return self.jobs.get((namespace, name))


def _status(code, reason, message):
    return code, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                  "message": message, "reason": reason, "code": code}


class _Handler(BaseHTTPRequestHandler):
    api = None  # the FakeApiServer

    def log_message(self, *args):
        pass

    def _reply(self, code, body, content_type="application/json", retry_after=None):
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(code)
        if retry_after is not None:
            self.send_header("Retry-After", retry_after)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method):
        api = self.api
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        with api.lock:
            api.requests.append((method, url.path, query, body))
            with_cert = isinstance(self.connection, ssl.SSLSocket) and \
                self.connection.getpeercert()
            if self.headers.get("Authorization") != f"Bearer {TOKEN}" and not with_cert:
                return self._reply(*_status(401, "Unauthorized", "Unauthorized"))
            injected = None
            for fault in api.faults:
                if fault[0] == method and fault[1] in url.path and fault[3] > 0:
                    fault[3] -= 1
                    injected = fault
                    break
            options = injected[4] if injected and len(injected) > 4 else {}
            if injected and not options.get("done"):
                return self._reply(*_status(injected[2], "ServiceUnavailable", "injected"),
                                   retry_after=options.get("retry_after"))
            if body is not None and self.headers.get("Content-Type") != "application/json":
                api.errors.append(f"{method} {url.path}: Content-Type "
                                  f"{self.headers.get('Content-Type')!r}")
            try:
                code, reply = self._route(method, url.path, query, body)
            except AssertionError as e:
                api.errors.append(f"{method} {url.path}: {e}")
                code, reply = _status(422, "Invalid", str(e))
            if injected:
                return self._reply(*_status(injected[2], "ServiceUnavailable", "injected"))
        if isinstance(reply, str):
            return self._reply(code, reply, "text/plain")
        return self._reply(code, reply)

    def _route(self, method, path, query, body):
        api = self.api
        parts = path.strip("/").split("/")
        # /api/v1/namespaces/NS/pods[/NAME[/log]]
        if parts[:2] == ["api", "v1"] and len(parts) >= 5 and parts[2] == "namespaces" \
                and parts[4] == "pods":
            return self._pods(method, parts[3], parts[5:], query, body)
        if parts[:3] == ["apis", "batch", "v1"] and len(parts) >= 6 and parts[3] == "namespaces" \
                and parts[5] == "jobs":
            return self._jobs(method, parts[4], parts[6:], query, body)
        if parts[:3] == ["apis", "metrics.k8s.io", "v1beta1"] and method == "GET":
            ns, name = parts[4], parts[6]
            pod = api.pods.get((ns, name))
            if pod is None or pod["status"]["phase"] != "Running":
                return _status(404, "NotFound", f"podmetrics \"{name}\" not found")
            return 200, {"kind": "PodMetrics", "metadata": {"name": name}, "containers": [
                {"name": "main", "usage": {"cpu": "1000000n", "memory": "2048Ki"}}]}
        raise AssertionError(f"no such API path {path}")

    def _pods(self, method, ns, rest, query, body):
        api = self.api
        if not rest and method == "GET":
            items = [p for (n, _), p in api.pods.items()
                     if n == ns and selector_matches(query.get("labelSelector"),
                                                     p["metadata"].get("labels", {}))]
            return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}
        if not rest and method == "POST":
            build_model(body, "V1Pod", "pod")
            assert body["apiVersion"] == "v1" and body["kind"] == "Pod", body
            assert body["metadata"]["namespace"] == ns, body["metadata"]
            name = body["metadata"]["name"]
            api.pods_at_post.setdefault(name, sorted(n for _, n in api.pods))
            if (ns, name) in api.pods:
                return _status(409, "AlreadyExists", f"pods \"{name}\" already exists")
            api.add_pod(ns, json.loads(json.dumps(body)))
            return 201, api.pods[(ns, name)]
        name = rest[0]
        pod = api.pods.get((ns, name))
        if pod is None:
            return _status(404, "NotFound", f"pods \"{name}\" not found")
        if rest[1:] == ["log"] and method == "GET":
            if pod["status"]["phase"] == "Pending":
                return _status(400, "BadRequest", "container \"main\" is waiting to start")
            job = pod["metadata"].get("labels", {}).get("job-name")
            outcome = api.outcomes.get(job or name) or Outcome()
            return 200, outcome.logs
        if rest[1:]:
            raise AssertionError(f"no such pod subresource {rest[1:]}")
        if method == "GET":
            api.advance(ns, name)
            return 200, pod
        if method == "DELETE":
            assert "gracePeriodSeconds" in query, f"DELETE pod without gracePeriodSeconds: {query}"
            del api.pods[(ns, name)]
            return 200, pod
        raise AssertionError(f"{method} on a pod")

    def _jobs(self, method, ns, rest, query, body):
        api = self.api
        if not rest and method == "GET":
            items = [j for (n, _), j in api.jobs.items()
                     if n == ns and selector_matches(query.get("labelSelector"),
                                                     j["metadata"].get("labels", {}))]
            return 200, {"kind": "JobList", "apiVersion": "batch/v1", "metadata": {}, "items": items}
        if not rest and method == "POST":
            build_model(body, "V1Job", "job")
            assert body["apiVersion"] == "batch/v1" and body["kind"] == "Job", body
            name = body["metadata"]["name"]
            job = json.loads(json.dumps(body))
            job["status"] = {}
            api.jobs[(ns, name)] = job
            # The job controller: one pod from the template.
            template = body["spec"]["template"]
            pod = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": f"{name}-x7k2p",
                                "labels": dict(template["metadata"]["labels"])},
                   "spec": json.loads(json.dumps(template["spec"]))}
            api.add_pod(ns, pod, owner_job=name)
            return 201, job
        name = rest[0]
        job = api.jobs.get((ns, name))
        if job is None:
            return _status(404, "NotFound", f"jobs.batch \"{name}\" not found")
        if method == "GET":
            return 200, job
        if method == "DELETE":
            policy = query.get("propagationPolicy")
            assert policy in ("Background", "Foreground", "Orphan"), query
            del api.jobs[(ns, name)]
            if policy != "Orphan":
                for key in [k for k, p in api.pods.items()
                            if p["metadata"].get("labels", {}).get("job-name") == name]:
                    del api.pods[key]
            return 200, job
        raise AssertionError(f"{method} on a job")

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    def do_DELETE(self):
        self._handle("DELETE")


@pytest.fixture
def api():
    server = FakeApiServer()
    yield server
    server.close()
    assert server.errors == []


def k8s_launcher(api, **options):
    options.setdefault("token", TOKEN)
    options.setdefault("namespace", "team-a")
    return launch.Launcher("kubernetes", server=api.url, id="kt1", **options)


@contextlib.contextmanager
def settled(api, launcher):
    """`launcher` as a context that, before closing it, waits until the
    supervisor removed every pod and job it made: the binding destroys a
    launcher holding the GIL, which this in-process server needs to answer."""
    with launcher:
        yield launcher
        api.wait_removed()


def spec(name, command=("sh", "-c", "true"), **kw):
    kw.setdefault("image", "busybox:1.36")
    return launch.ContainerSpec(name=name, command=list(command), **kw)


def allocation(mode="exclusive", gpus=2, node="n1", **request):
    alloc = deepnex.gpu.Allocator()
    alloc.add_node(deepnex.gpu.Node(node, gpus=[deepnex.gpu.Gpu(memory="16GiB")] * 4,
                                    cpus=8, memory="32GiB", mode=mode))
    return alloc.allocate(deepnex.gpu.Request(user="alice", gpus=gpus, mode=mode, cpus=2,
                                              memory="1GiB", **request))


def created_pod(api, ns="team-a"):
    posts = api.sent("POST", f"/api/v1/namespaces/{ns}/pods")
    assert len(posts) == 1, posts
    return posts[0][3]


# ---------------------------------------------------------------------------
# Tests.

def test_pod_runs_to_its_exit_code_with_the_manifest_asked_for(api, tmp_path):
    api.outcomes["kt1-w0-0"] = Outcome(exit_code=3, logs="hi\n", running_polls=2)
    with settled(api, k8s_launcher(api)) as launcher:
        h = launcher.start(spec(
            "w0", ["sh", "-c", "echo $(HOME) $$ > /dev/null; echo hi; exit 3"],
            env={"A": "1", "B": "$(A)"}, working_dir="/work", cpus=0.5, memory="64MiB",
            labels={"team": "vision"}))
        e = h.wait(timeout=30)
        assert (e.reason, e.code, e.restarts) == ("exited", 3, 0)
        assert h.logs() == "hi\n"

    pod = created_pod(api)
    labels = {"deepnex.launcher": "kt1", "deepnex.name": "w0", "team": "vision"}
    # The annotation marks this create's object as its own (a retried POST's 409).
    assert re.fullmatch("[0-9a-f]{32}", pod["metadata"]["annotations"].pop("deepnex.io/create"))
    assert pod["metadata"] == {"name": "kt1-w0-0", "namespace": "team-a", "labels": labels,
                               "annotations": {}}
    pod_spec = pod["spec"]
    assert pod_spec["restartPolicy"] == "Never"
    assert pod_spec["automountServiceAccountToken"] is False
    [c] = pod_spec["containers"]
    assert c["image"] == "busybox:1.36"
    # $ doubled: Kubernetes would expand $(VAR) and fold $$.
    assert c["args"] == ["sh", "-c", "echo $$(HOME) $$$$ > /dev/null; echo hi; exit 3"]
    assert "command" not in c
    env = {v["name"]: v["value"] for v in c["env"]}
    assert env["A"] == "1" and env["B"] == "$$(A)"
    assert c["workingDir"] == "/work"
    quantities = {"cpu": "500m", "memory": str(64 * MiB)}
    assert c["resources"] == {"requests": quantities, "limits": quantities}
    # No run_as: the launcher's own identity, not the image's user.
    uid, gid = os.geteuid(), os.getegid()
    caps = {"drop": ["ALL"]}
    if uid == 0:
        caps["add"] = ["AUDIT_WRITE", "KILL", "NET_BIND_SERVICE"]
    assert c["securityContext"] == {"allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True, "capabilities": caps}
    assert pod_spec["securityContext"] == dict(
        {"runAsUser": uid, "runAsGroup": gid, "seccompProfile": {"type": "RuntimeDefault"}},
        **({"runAsNonRoot": True} if uid else {}))
    assert env["HOME"] == ("/root" if uid == 0 else "/")
    assert c["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert pod_spec["volumes"] == [{"name": "tmp", "emptyDir": {}}]
    # Ended: the supervisor removed the pod.
    deletes = api.sent("DELETE", "/pods/kt1-w0-0")
    assert [d[2] for d in deletes] == [{"gracePeriodSeconds": "0"}]
    assert api.pods == {}


def test_long_names_stay_distinct_and_within_63_characters(api):
    # A job's containers differ only at the end of their names; cut to
    # Kubernetes' 63 characters they must not collide.
    job = "j" * 32  # deepnex run's launcher id is its job name
    names = [f"{job}-worker{i}" for i in range(2)]
    with settled(api, launch.Launcher("kubernetes", server=api.url, id=job, token=TOKEN,
                                      namespace="team-a")) as launcher:
        for n in names:
            assert launcher.start(spec(n, ["true"])).wait(timeout=30).reason == "exited"
    made = [r[3]["metadata"]["name"] for r in api.requests
            if r[0] == "POST" and r[1].endswith("/pods")]
    assert len(made) == 2 and len(set(made)) == 2, made
    assert all(len(m) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", m)
               for m in made), made


def test_names_that_differ_only_where_a_label_cannot_stay_distinct(api):
    """"forever.a" and "Forever_a" were both pod forever-a: one's start
    failed (409) with a message naming neither; through central, user a's
    "b-c" and user a-b's "c" met the same way. A name a label holds as it
    is keeps it."""
    names = ["forever.a", "Forever_a", "forever-a"]
    with settled(api, k8s_launcher(api)) as launcher:
        handles = [launcher.start(spec(n, ["true"])) for n in names]  # all at once
        assert [h.wait(timeout=30).reason for h in handles] == ["exited"] * 3
    made = [r[3]["metadata"]["name"] for r in api.requests
            if r[0] == "POST" and r[1].endswith("/pods")]
    assert len(set(made)) == 3 and "kt1-forever-a-0" in made, made
    assert all(len(m) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", m)
               for m in made), made


def test_success_oom_and_eviction(api):
    api.outcomes["kt1-ok-0"] = Outcome(exit_code=0)
    api.outcomes["kt1-hog-0"] = Outcome(exit_code=137, reason="OOMKilled")
    api.outcomes["kt1-evicted-0"] = Outcome(phase_only="Failed")
    with settled(api, k8s_launcher(api)) as launcher:
        ok = launcher.start(spec("ok"))
        hog = launcher.start(spec("hog", memory="16MiB"))
        evicted = launcher.start(spec("evicted"))
        e = ok.wait(timeout=30)
        assert e.ok and str(e) == "exited(0)"
        e = hog.wait(timeout=30)
        assert (e.reason, e.code, e.signal) == ("oom_killed", 137, 9)
        assert evicted.wait(timeout=30).reason == "lost"


def test_a_few_failed_polls_of_a_running_pod_do_not_end_it(api):
    # One 503 used to end the pod as lost: the supervisor deleted a healthy
    # pod and started another. An API server that stays silent for 30 s
    # still does (as slurmctld does).
    api.outcomes["kt1-steady-0"] = Outcome(running_polls=8)
    with settled(api, k8s_launcher(api)) as launcher:
        h = launcher.start(spec("steady", restart="on-failure:3"))
        wait_for(lambda: h.status().state == "running", "the pod to run")
        with api.lock:
            api.faults.append(["GET", "/pods/kt1-steady-0", 503, 3])
        e = h.wait(timeout=60)
        assert (str(e), e.restarts) == ("exited(0)", 0)
        assert "lost run" not in h.logs()
    assert len(api.sent("POST", "/pods")) == 1  # no second pod


def test_a_start_rides_out_busy_answers_and_honours_retry_after(api):
    # One 429 or 503 used to fail the start.
    api.outcomes["kt1-busy-0"] = Outcome()
    api.faults.append(["POST", "/pods", 503, 2])
    api.faults.append(["POST", "/pods", 429, 1, {"retry_after": "1"}])
    with settled(api, k8s_launcher(api)) as launcher:
        began = time.monotonic()
        h = launcher.start(spec("busy"))
        assert time.monotonic() - began >= 1.0  # Retry-After: 1
        assert h.wait(timeout=30).ok
    assert len(api.sent("POST", "/pods")) == 4


def test_a_retried_create_whose_first_try_made_the_pod_takes_it_as_its_own(api):
    # The first POST made the pod but its answer was a proxy's 504: the
    # retry's 409 AlreadyExists is this create's own pod, not a failure.
    api.outcomes["kt1-made-0"] = Outcome()
    api.faults.append(["POST", "/pods", 504, 1, {"done": True}])
    with settled(api, k8s_launcher(api)) as launcher:
        assert launcher.start(spec("made")).wait(timeout=30).ok
    assert len(api.sent("POST", "/pods")) == 2
    assert api.pods == {}


def test_a_pod_of_the_name_that_is_not_ours_is_already_exists_and_stays(api):
    # A leftover of an earlier launcher with this id: the same name and
    # labels, but not this create's.
    api.add_pod("team-a", {"metadata": {"name": "kt1-w0-0", "labels": {
        "deepnex.launcher": "kt1", "deepnex.name": "w0"}}, "spec": {}})
    with k8s_launcher(api) as launcher:
        with pytest.raises(deepnex.AlreadyExistsError, match="already exists"):
            launcher.start(spec("w0"))
    assert list(api.pods) == [("team-a", "kt1-w0-0")]
    assert api.sent("DELETE") == []


def test_a_failed_create_that_made_the_pod_deletes_it(api):
    # The first POST made the pod, its answer was lost (504) and the retry
    # was refused: the pod would have run unwatched and held the name.
    api.faults.append(["POST", "/pods", 504, 1, {"done": True}])
    api.faults.append(["POST", "/pods", 403, 1])
    api.faults.append(["DELETE", "/pods/kt1-w0-0", 503, 1])  # retried too
    with settled(api, k8s_launcher(api)) as launcher:
        with pytest.raises(deepnex.PermissionDeniedError, match="HTTP 403"):
            launcher.start(spec("w0"))
    assert api.pods == {}
    assert [d[2] for d in api.sent("DELETE", "/pods/kt1-w0-0")] == [{"gracePeriodSeconds": "0"}] * 2


def test_a_restart_waits_until_the_last_pod_is_deleted(api):
    # A DELETE that failed once was ignored: the next pod ran beside the
    # old one, which was never deleted (an outage ran a worker twice).
    api.outcomes["kt1-w0-0"] = Outcome(exit_code=1)
    api.outcomes["kt1-w0-1"] = Outcome(exit_code=0)
    api.faults.append(["DELETE", "/pods/kt1-w0-0", 503, 3])
    api.faults.append(["DELETE", "/pods/kt1-w0-1", 500, 2])  # after the last run too
    with settled(api, k8s_launcher(api)) as launcher:
        e = launcher.start(spec("w0", restart="on-failure:1")).wait(timeout=60)
        assert (str(e), e.restarts) == ("exited(0) after 1 restart", 1)
    assert "kt1-w0-0" not in api.pods_at_post["kt1-w0-1"]
    wait_for(lambda: api.pods == {}, "the last pod to be deleted")


def test_stop_deletes_the_pod_with_the_grace(api):
    api.outcomes["kt1-server-0"] = Outcome(forever=True, logs="serving\n")
    with settled(api, k8s_launcher(api)) as launcher:
        h = launcher.start(spec("server", ["sleep", "1000"]))
        wait_for(lambda: h.status().state == "running", "the pod to run")
        with pytest.raises(deepnex.DeadlineExceededError):
            h.wait(timeout=0.5)
        usage = h.usage()  # from the metrics API while it runs
        assert usage.memory == 2048 * 1024 and usage.memory_peak == 2048 * 1024
        h.stop(grace=2.5)
        e = h.wait(timeout=10)
        assert (e.reason, e.signal) == ("signaled", 15)
        # The logs were read before the pod went.
        assert h.logs() == "serving\n"
    deletes = api.sent("DELETE", "/pods/kt1-server-0")
    assert deletes[0][2] == {"gracePeriodSeconds": "3"}


def test_exclusive_gpus_are_nvidia_gpu_limits(api):
    a = allocation(gpus=2)
    api.outcomes["kt1-gpu-0"] = Outcome()
    with settled(api, k8s_launcher(api)) as launcher:
        assert launcher.start(spec("gpu", allocation=a)).wait(timeout=30).ok
    [c] = created_pod(api)["spec"]["containers"]
    quantities = {"cpu": "2000m", "memory": str(1024 * MiB), "nvidia.com/gpu": "2"}
    assert c["resources"] == {"requests": quantities, "limits": quantities}
    env = {v["name"]: v["value"] for v in c["env"]}
    # The device plugin chooses the node's GPUs and sets NVIDIA_VISIBLE_DEVICES.
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert "NVIDIA_VISIBLE_DEVICES" not in env


def test_host_mounts_are_refused_for_a_pod_on_another_node(api, tmp_path):
    """The launcher checks a mount's source on its own host (allowed roots,
    symlinks), but a hostPath resolves on the pod's node: on node n1 the
    same path could be anything."""
    with settled(api, k8s_launcher(api)) as launcher:
        with pytest.raises(deepnex.FailedPreconditionError,
                           match=r'spec.mounts: the pod runs on node "n1", whose kubelet would '
                                 r'resolve the host paths there, but they were checked on this '
                                 rf'host \("{socket.gethostname()}"\)'):
            launcher.start(spec("mounted", allocation=allocation(gpus=1),
                                mounts=[launch.Mount(str(tmp_path), "/data")]))
    assert api.sent("POST", "/api/v1/namespaces/team-a/pods") == []


def test_host_mounts_are_refused_for_a_pod_the_scheduler_places(api, tmp_path):
    """Without an allocation naming its node the pod could land on any
    node, where the checked path could be anything, or nothing, which the
    kubelet would make."""
    with settled(api, k8s_launcher(api)) as launcher:
        with pytest.raises(deepnex.InvalidArgumentError,
                           match=rf'spec.mounts\[0\]: "{tmp_path}": host mounts need the pod on '
                                 r"the launcher's host.*could put it on any node"):
            launcher.start(spec("anywhere", mounts=[launch.Mount(str(tmp_path), "/data")]))
    assert api.sent("POST") == []


def test_host_mounts_of_a_pod_on_this_host_say_what_they_mount(api, tmp_path):
    """hostPath.type Directory or File: the kubelet mounts only what is
    there, instead of making a missing path."""
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("x")
    api.outcomes["kt1-mounted-0"] = Outcome()
    with settled(api, k8s_launcher(api)) as launcher:
        h = launcher.start(spec("mounted", allocation=allocation(gpus=1, node=socket.gethostname()),
                                mounts=[launch.Mount(str(tmp_path / "d"), "/data"),
                                        launch.Mount(str(tmp_path / "f"), "/etc/x.conf")]))
        assert h.wait(timeout=30).ok
    pod_spec = created_pod(api)["spec"]
    assert pod_spec["nodeName"] == socket.gethostname()
    assert pod_spec["volumes"] == [
        {"name": "mount-0", "hostPath": {"path": str(tmp_path / "d"), "type": "Directory"}},
        {"name": "mount-1", "hostPath": {"path": str(tmp_path / "f"), "type": "File"}},
        {"name": "tmp", "emptyDir": {}}]
    assert pod_spec["containers"][0]["volumeMounts"] == [
        {"name": "mount-0", "mountPath": "/data", "readOnly": True},
        {"name": "mount-1", "mountPath": "/etc/x.conf", "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"}]


def test_a_namespace_that_is_no_dns_label_is_refused_naming_it(api):
    # It went into every URL as it was: "a/pods/x?" named another path.
    for bad in ("team-a/../kube-system", "Team-A", "-a", "a" * 64, "a?b"):
        with pytest.raises(deepnex.InvalidArgumentError,
                           match=f'kubernetes namespace "{re.escape(bad)}" is not a DNS-1123 label'):
            k8s_launcher(api, namespace=bad)
    assert api.requests == []


def test_pod_goes_to_the_allocations_node(api):
    api.outcomes["kt1-placed-0"] = Outcome()
    api.outcomes["kt1-free-0"] = Outcome()
    with settled(api, k8s_launcher(api)) as launcher:
        assert launcher.start(spec("placed", allocation=allocation(gpus=1))).wait(timeout=30).ok
        assert launcher.start(spec("free")).wait(timeout=30).ok
    posts = api.sent("POST", "/api/v1/namespaces/team-a/pods")
    pods = {p[3]["metadata"]["name"]: p[3]["spec"] for p in posts}
    assert pods["kt1-placed-0"]["nodeName"] == "n1"
    # Without an allocation the cluster's scheduler chooses.
    assert "nodeName" not in pods["kt1-free-0"]


def test_shared_gpu_memory_is_the_extended_resource(api):
    a = allocation(mode="shared", gpus=1, gpu_memory="3GiB")
    api.outcomes["kt1-small-0"] = Outcome()
    launcher = k8s_launcher(api, shared_gpu_memory_resource="example.com/gpu-mem")
    with settled(api, launcher):
        assert launcher.start(spec("small", allocation=a)).wait(timeout=30).ok
    [c] = created_pod(api)["spec"]["containers"]
    quantities = {"cpu": "2000m", "memory": str(1024 * MiB), "example.com/gpu-mem": "3072"}
    assert c["resources"] == {"requests": quantities, "limits": quantities}
    env = {v["name"]: v["value"] for v in c["env"]}
    assert env["DEEPNEX_GPU_MEMORY_LIMIT"] == str(3 << 30)
    assert env["CUDA_VISIBLE_DEVICES"] == "0"


def test_job_kind_runs_a_batch_job_of_one_pod(api):
    api.outcomes["kt1-train-0"] = Outcome(exit_code=2, logs="step 1\n")
    with settled(api, k8s_launcher(api, kind="job")) as launcher:
        h = launcher.start(spec("train", labels={"team": "nlp"}))
        e = h.wait(timeout=30)
        assert (e.reason, e.code) == ("exited", 2)
        assert h.logs() == "step 1\n"
    [post] = api.sent("POST", "/apis/batch/v1/namespaces/team-a/jobs")
    job = post[3]
    labels = {"deepnex.launcher": "kt1", "deepnex.name": "train", "team": "nlp"}
    assert "deepnex.io/create" in job["metadata"].pop("annotations")
    assert job["metadata"] == {"name": "kt1-train-0", "namespace": "team-a", "labels": labels}
    assert job["spec"]["backoffLimit"] == 0
    assert job["spec"]["template"]["metadata"] == {"labels": labels}
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    # Its pod was found through the job controller's label.
    assert any(r[2].get("labelSelector") == "job-name=kt1-train-0"
               for r in api.sent("GET", "/api/v1/namespaces/team-a/pods"))
    # Removed with its pod.
    deletes = api.sent("DELETE", "/jobs/kt1-train-0")
    assert deletes[-1][2]["propagationPolicy"] == "Background"
    assert api.jobs == {} and api.pods == {}


def test_stop_of_a_job_orphans_its_pod_then_deletes_it_with_the_grace(api):
    api.outcomes["kt1-long-0"] = Outcome(forever=True)
    with settled(api, k8s_launcher(api, kind="job")) as launcher:
        h = launcher.start(spec("long"))
        with pytest.raises(deepnex.DeadlineExceededError):
            h.wait(timeout=0.6)
        h.stop(grace=1)
        assert h.wait(timeout=10).reason == "signaled"
    assert api.sent("DELETE", "/jobs/kt1-long-0")[0][2] == {"propagationPolicy": "Orphan"}
    assert api.sent("DELETE", "/pods/kt1-long-0-x7k2p")[0][2] == {"gracePeriodSeconds": "1"}
    assert api.pods == {}


def test_wrong_token_is_unauthenticated(api):
    with pytest.raises(deepnex.UnauthenticatedError, match="HTTP 401: Unauthorized"):
        k8s_launcher(api, token="wrong")
    assert api.requests[-1][1] == "/api/v1/namespaces/team-a/pods"


def test_unreachable_server_is_failed_precondition():
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(deepnex.FailedPreconditionError, match="does not answer"):
        launch.Launcher("kubernetes", server=f"http://127.0.0.1:{port}", token=TOKEN)


def test_specs_a_pod_cannot_express_are_refused(api):
    with settled(api, k8s_launcher(api)) as launcher:
        with pytest.raises(deepnex.InvalidArgumentError, match="spec.network_none"):
            launcher.start(spec("isolated", network_none=True))
        with pytest.raises(deepnex.InvalidArgumentError, match="spec.image"):
            launcher.start(spec("hosty", image="host"))
        with pytest.raises(deepnex.InvalidArgumentError, match="spec.labels"):
            launcher.start(spec("labelled", labels={"team": "a b"}))
        # A pod with another job's job-name would pass for that job's pod.
        for key in ("job-name", "controller-uid", "batch.kubernetes.io/job-name"):
            with pytest.raises(deepnex.InvalidArgumentError,
                               match=f'spec.labels: "{key}" is set by Kubernetes. job controller'):
                launcher.start(spec("posing", labels={key: "kt1-other-0"}))
        # Refused, not dropped from the manifest.
        with pytest.raises(deepnex.InvalidArgumentError, match="spec.pids_limit: 5: "):
            launcher.start(spec("forky", pids_limit=5))
        with pytest.raises(deepnex.InvalidArgumentError, match="spec.host_network: true"):
            launcher.start(spec("hosted", host_network=True))
        with pytest.raises(deepnex.InvalidArgumentError, match='spec.name: "w_"'):
            launcher.start(spec("w_"))
        assert api.sent("POST") == []
    with pytest.raises(deepnex.InvalidArgumentError, match="kubernetes.kind"):
        k8s_launcher(api, kind="deployment")


def test_cleanup_sweeps_what_a_crashed_launcher_left(api):
    left = {"deepnex.launcher": "gone1", "deepnex.name": "x"}
    for name in ("gone1-a-0", "gone1-b-3"):
        api.add_pod("team-a", {"metadata": {"name": name, "labels": dict(left)}, "spec": {}})
    api.jobs[("team-a", "gone1-j-0")] = {"metadata": {"name": "gone1-j-0", "labels": dict(left)}}
    api.add_pod("team-a", {"metadata": {"name": "gone1-j-0-abcde", "labels": dict(left)},
                           "spec": {}}, owner_job="gone1-j-0")
    # A job's pod whose job is gone: a Stop deletes the job first (orphaning
    # the pod), and a launcher that crashed before deleting the pod left it.
    api.add_pod("team-a", {"metadata": {"name": "gone1-k-0-fghij", "labels": dict(
        left, **{"job-name": "gone1-k-0"})}, "spec": {}})
    other = {"deepnex.launcher": "other", "deepnex.name": "y"}
    api.add_pod("team-a", {"metadata": {"name": "other-y-0", "labels": other}, "spec": {}})
    with settled(api, k8s_launcher(api)) as launcher:
        # Three pods and a job (its pod goes with it).
        assert launcher.cleanup("gone1") == 4
    assert list(api.pods) == [("team-a", "other-y-0")]
    assert api.jobs == {}


def _make_cert(tmp_path, name="server"):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=deepnex-test", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


@pytest.fixture
def tls_api(tmp_path):
    cert, key = _make_cert(tmp_path)
    server = FakeApiServer(tls_cert=str(cert), tls_key=str(key))
    server.cert = cert
    yield server
    server.close()
    assert server.errors == []


def test_tls_with_the_ca_file_and_not_without(tls_api):
    tls_api.outcomes["kt1-w0-0"] = Outcome(logs="over tls\n")
    with settled(tls_api, k8s_launcher(tls_api, ca_file=str(tls_api.cert))) as launcher:
        h = launcher.start(spec("w0"))
        assert h.wait(timeout=30).ok
        assert h.logs() == "over tls\n"
    # The system CAs do not know the test's certificate.
    with pytest.raises(deepnex.FailedPreconditionError, match="certificate"):
        k8s_launcher(tls_api)


def test_kubeconfig_current_context_with_ca_data_token_and_namespace(tls_api, tmp_path):
    ca_data = base64.b64encode(tls_api.cert.read_bytes()).decode()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(f"""
apiVersion: v1
kind: Config
current-context: ci
clusters:
- name: elsewhere
  cluster:
    server: https://192.0.2.1:6443
- name: local
  cluster:
    server: {tls_api.url}
    certificate-authority-data: {ca_data}
users:
- name: robot
  user:
    token: {TOKEN}
contexts:
- name: other
  context: {{cluster: elsewhere, user: robot}}
- name: ci
  context:
    cluster: local
    user: robot
    namespace: ml
""")
    tls_api.outcomes["kt1-w1-0"] = Outcome()
    with settled(tls_api, launch.Launcher("kubernetes", kubeconfig=str(kubeconfig),
                                         id="kt1")) as launcher:
        assert launcher.start(spec("w1")).wait(timeout=30).ok
    created_pod(tls_api, ns="ml")

    # A token file beside it, named relative to the kubeconfig.
    (tmp_path / "token").write_text(TOKEN + "\n")
    kubeconfig.write_text(kubeconfig.read_text().replace(f"token: {TOKEN}", "tokenFile: token"))
    with launch.Launcher("kubernetes", kubeconfig=str(kubeconfig), id="kt2") as launcher:
        assert launcher.backend == "kubernetes"

    kubeconfig.write_text(kubeconfig.read_text().replace("current-context: ci",
                                                         "current-context: nope"))
    with pytest.raises(deepnex.InvalidArgumentError, match='no context named "nope"'):
        launch.Launcher("kubernetes", kubeconfig=str(kubeconfig))


def test_kubeconfig_client_certificate(tmp_path):
    server_cert, server_key = _make_cert(tmp_path)
    client_cert, client_key = _make_cert(tmp_path, "client")
    api = FakeApiServer(tls_cert=str(server_cert), tls_key=str(server_key),
                        client_ca=str(client_cert))
    try:
        def b64(path):
            return base64.b64encode(path.read_bytes()).decode()
        kubeconfig = tmp_path / "kubeconfig"
        # The CA as a file named relative to the kubeconfig; no token.
        kubeconfig.write_text(f"""
apiVersion: v1
kind: Config
current-context: c
clusters: [{{name: k, cluster: {{server: "{api.url}", certificate-authority: server.crt}}}}]
users:
- name: u
  user:
    client-certificate-data: {b64(client_cert)}
    client-key-data: {b64(client_key)}
contexts: [{{name: c, context: {{cluster: k, user: u}}}}]
""")
        api.outcomes["kt1-w0-0"] = Outcome()
        with settled(api, launch.Launcher("kubernetes", kubeconfig=str(kubeconfig),
                                          id="kt1")) as launcher:
            assert launcher.start(spec("w0")).wait(timeout=30).ok
        created_pod(api, ns="default")
        # Without the certificate the server does not let it in.
        with pytest.raises(deepnex.FailedPreconditionError, match="does not answer"):
            launch.Launcher("kubernetes", server=api.url, ca_file=str(server_cert))
        # A key that is not the certificate's is the kubeconfig's fault.
        kubeconfig.write_text(kubeconfig.read_text().replace(b64(client_key), b64(server_key)))
        with pytest.raises(deepnex.InvalidArgumentError, match="client certificate"):
            launch.Launcher("kubernetes", kubeconfig=str(kubeconfig))
        assert api.errors == []
    finally:
        api.close()


def plain_kubeconfig(path, server):
    """A kubeconfig whose current context is `server` with TOKEN, namespace ml."""
    path.write_text(f"""
apiVersion: v1
kind: Config
current-context: ci
clusters: [{{name: local, cluster: {{server: "{server}"}}}}]
users: [{{name: robot, user: {{token: {TOKEN}}}}}]
contexts: [{{name: ci, context: {{cluster: local, user: robot, namespace: ml}}}}]
""")
    return path


def test_without_a_kubeconfig_option_it_is_kubectls(api, tmp_path, monkeypatch):
    """No kubeconfig given: as kubectl, the first file of $KUBECONFIG that
    exists, else ~/.kube/config. Only the in-cluster account was tried, so
    a `deepnex run --backend kubernetes` (which gives no kubeconfig) could
    not run from a workstation."""
    home = tmp_path / "home"
    (home / ".kube").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    plain_kubeconfig(home / ".kube" / "config", api.url)
    with launch.Launcher("kubernetes", id="kt1") as launcher:
        assert launcher.backend == "kubernetes"
    assert api.sent("GET", "/api/v1/namespaces/ml/pods")
    # $KUBECONFIG first; its files that do not exist are passed over.
    other = FakeApiServer()
    try:
        monkeypatch.setenv("KUBECONFIG", f"{tmp_path}/missing::"
                           f"{plain_kubeconfig(tmp_path / 'kc', other.url)}")
        with launch.Launcher("kubernetes", id="kt2") as launcher:
            assert launcher.backend == "kubernetes"
        assert other.sent("GET", "/api/v1/namespaces/ml/pods")
        assert other.errors == []
    finally:
        other.close()
    # A $KUBECONFIG none of whose files exists is meant, and said.
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path}/missing")
    with pytest.raises(deepnex.NotFoundError) as e:
        launch.Launcher("kubernetes")
    assert str(e.value) == (f'kubernetes: KUBECONFIG="{tmp_path}/missing": none of its files '
                            "exists")


def test_deepnex_run_runs_its_workers_as_pods_of_its_image(api, tmp_path):
    """`deepnex run --backend kubernetes --image`, through the kubeconfig of
    $KUBECONFIG: each worker a pod of the image with the job's variables
    and not the shell's. Before --image a job's containers were of the host
    image, which a pod cannot run, so no job ran on kubernetes."""
    env = dict(os.environ, KUBECONFIG=str(plain_kubeconfig(tmp_path / "kc", api.url)),
               DEEPNEX_RUN_DIR=str(tmp_path / "run"), SECRET_FROM_SHELL="leaked")
    out = subprocess.run(
        [sys.executable, "-m", "deepnex", "run", "--name", "k8s-job", "--backend", "kubernetes",
         "--image", "busybox:1.36", "--workers", "2", "--mode", "allreduce", "--",
         "sh", "-c", "true"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "job k8s-job: 2 workers, mode allreduce, backend kubernetes" in out.stderr
    pods = sorted((p[3] for p in api.sent("POST", "/api/v1/namespaces/ml/pods")),
                  key=lambda pod: pod["metadata"]["name"])
    assert [pod["metadata"]["labels"]["deepnex.role"] for pod in pods] == ["worker"] * 2
    for rank, pod in enumerate(pods):
        [c] = pod["spec"]["containers"]
        assert c["image"] == "busybox:1.36"
        assert "workingDir" not in c  # the image's
        variables = {v["name"]: v["value"] for v in c["env"]}
        assert (variables["RANK"], variables["WORLD_SIZE"]) == (str(rank), "2")
        assert "SECRET_FROM_SHELL" not in variables and "PATH" not in variables
        # On the pod network, where this host's loopback is the pod's own.
        assert "hostNetwork" not in pod["spec"]
        assert not variables["DEEPNEX_STORE_ADDR"].startswith("127."), variables
    api.wait_removed()


def test_in_cluster_without_a_service_account_says_what_is_missing(monkeypatch, tmp_path):
    if os.path.exists("/var/run/secrets/kubernetes.io/serviceaccount"):
        pytest.skip("this machine runs in a Kubernetes pod")
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    with pytest.raises(deepnex.FailedPreconditionError, match="KUBERNETES_SERVICE_HOST"):
        launch.Launcher("kubernetes")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    with pytest.raises(deepnex.NotFoundError,
                       match="/var/run/secrets/kubernetes.io/serviceaccount/token"):
        launch.Launcher("kubernetes")
