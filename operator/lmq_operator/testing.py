"""A real kube-apiserver + etcd on loopback, and the operator as a real process, for tests and benchmarks.

envtest-style: no kubelet, no controllers; enough for CRDs, CEL, status, finalizers, watches and the Table
API. The binaries are built once by ``make testenv`` (scripts/testenv-build.sh) and cached outside the repo;
a missing binary is an error naming that command, never a reason to skip.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

import yaml

REPO: Final = Path(__file__).resolve().parents[2]
CRD_DIR: Final = REPO / "crds"
START_TIMEOUT_S: Final = 90.0
APISERVER_ATTEMPTS: Final = 2
OPERATOR_USER: Final = "lmq-operator"
T = TypeVar("T")
logger = logging.getLogger(__name__)


def cr_path(plural: str, namespace: str, name: str = "") -> str:
    """REST path of lmq.io custom resources (a collection, or one object when ``name`` is given)."""
    base = f"/apis/lmq.io/v1alpha1/namespaces/{namespace}/{plural}"
    return f"{base}/{name}" if name else base


def host_ip() -> str:
    """A non-loopback address of this machine (EndpointSlices refuse 127.0.0.0/8); no packet is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.255", 1))
        ip = str(s.getsockname()[0])
    if ip.startswith("127."):
        raise RuntimeError("this machine has no non-loopback IPv4 address for EndpointSlice tests")
    return ip


class TestenvMissing(RuntimeError):
    pass


def bin_dir() -> Path:
    root = os.environ.get("LMQ_TESTENV_DIR") or str(Path.home() / ".cache" / "lmq-testenv")
    return Path(root) / "bin"


def binaries() -> tuple[Path, Path]:
    etcd, apiserver = bin_dir() / "etcd", bin_dir() / "kube-apiserver"
    missing = [str(p) for p in (etcd, apiserver) if not os.access(p, os.X_OK)]
    if missing:
        raise TestenvMissing(f"missing {', '.join(missing)}: run `make testenv` to build kube-apiserver and etcd")
    return etcd, apiserver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(
    check: Callable[[], T | None],
    timeout_s: float,
    what: str,
    interval_s: float = 0.05,
    detail: Callable[[], str] | None = None,
) -> T:
    """Poll ``check`` until it returns something truthy; fail with ``what`` after ``timeout_s``, followed by
    ``detail()`` read at that moment (a log tail, say)."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while True:
        try:
            result = check()
            if result:
                return result
        except Exception as exc:  # polled conditions may fail until they hold
            last_error = exc
        if time.monotonic() > deadline:
            suffix = f" (last error: {last_error!r})" if last_error else ""
            more = f"\n{detail()}" if detail else ""
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}{suffix}{more}")
        time.sleep(interval_s)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(d: Path, reachable_at: Sequence[str] = ()) -> None:
    """A CA, a serving cert for 127.0.0.1/localhost (and the ``reachable_at`` addresses) signed by it, and the
    service-account key pair."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=lmq-testenv-ca",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=d)  # fmt: skip
    sans = ",".join(["IP:127.0.0.1", "DNS:localhost", *(f"IP:{ip}" for ip in reachable_at)])
    (d / "serving.ext").write_text(
        f"subjectAltName={sans}\nextendedKeyUsage=serverAuth\nkeyUsage=digitalSignature,keyEncipherment\n"
    )
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "serving.key",
             "-out", "serving.csr", cwd=d)  # fmt: skip
    _openssl("x509", "-req", "-in", "serving.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", "serving.ext", "-out", "serving.crt", cwd=d)  # fmt: skip
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)


class ApiError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        message = body.get("message") if isinstance(body, dict) else str(body)
        super().__init__(f"{status}: {message}")
        self.status = status
        self.body = body
        self.message = str(message)


@dataclass
class KubeAPI:
    """A tiny JSON client for the test apiserver (the tests need raw access: Table API, status, patches)."""

    server: str
    token: str
    ca_file: Path
    kubeconfig: Path
    operator_token: str = ""  # user "lmq-operator": authenticated, no groups, no permissions until bound

    def __post_init__(self) -> None:
        self._ssl = ssl.create_default_context(cafile=str(self.ca_file))

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        accept: str = "application/json",
        timeout_s: float = 30.0,
        parse: bool = True,
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self.token}", "Accept": accept}
        if data is not None:
            headers["Content-Type"] = content_type
        req = urllib.request.Request(self.server + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, context=self._ssl, timeout=timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                parsed = json.loads(raw)
            except ValueError:
                parsed = raw.decode(errors="replace")
            raise ApiError(exc.code, parsed) from None
        if not parse:
            return raw.decode(errors="replace")
        return json.loads(raw) if raw else None

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: Any) -> Any:
        return self.request("POST", path, body)

    def merge_patch(self, path: str, body: Any) -> Any:
        return self.request("PATCH", path, body, content_type="application/merge-patch+json")

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)

    def exists(self, path: str) -> bool:
        try:
            self.get(path)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def ensure_namespace(self, name: str) -> None:
        with contextlib.suppress(ApiError):
            self.post("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})

    def apply_crds(self, crd_dir: Path = CRD_DIR, timeout_s: float = 30.0) -> list[str]:
        names = []
        for path in sorted(crd_dir.glob("*.yaml")):
            crd = yaml.safe_load(path.read_text())
            name = crd["metadata"]["name"]
            names.append(name)
            url = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
            self.request(
                "PATCH",
                url + "?fieldManager=lmq-tests&force=true",
                crd,
                content_type="application/apply-patch+yaml",
            )
        for name in names:
            url = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"

            def established(url: str = url) -> bool:
                conds = self.get(url).get("status", {}).get("conditions", [])
                return any(c["type"] == "Established" and c["status"] == "True" for c in conds)

            wait_for(established, timeout_s, f"CRD {name} Established")
        return names


def _stop(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL. A process that outlives even SIGKILL (stuck in the kernel) is reported, not
    raised: cleanup must not hide the error that led to it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                state = _machine_state(proc.pid)
                logger.warning("%.80r still running %.0fs after SIGKILL: %s", proc.args, timeout_s, state)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _start_apiserver(
    binary: Path, workdir: Path, etcd_port: int, api: KubeAPI, log: Path, *, bind: str = "127.0.0.1"
) -> subprocess.Popen[bytes]:
    port = api.server.rsplit(":", 1)[1]
    with log.open("wb") as out:
        return subprocess.Popen(
            [
                str(binary),
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                f"--bind-address={bind}",
                "--advertise-address=127.0.0.1",
                f"--secure-port={port}",
                f"--cert-dir={workdir}",
                f"--tls-cert-file={workdir / 'serving.crt'}",
                f"--tls-private-key-file={workdir / 'serving.key'}",
                f"--client-ca-file={workdir / 'ca.crt'}",
                f"--token-auth-file={workdir / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                "--disable-admission-plugins=ServiceAccount",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={workdir / 'sa.pub'}",
                f"--service-account-signing-key-file={workdir / 'sa.key'}",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--allow-privileged=true",
                "--profiling=false",
                "--v=0",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _wait_ready(api: KubeAPI, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"kube-apiserver exited with {proc.returncode}:\n{_tail(log)}")
        return bool(api.request("GET", "/readyz", accept="*/*", timeout_s=5, parse=False).strip() == "ok")

    def detail() -> str:
        return f"{_machine_state(proc.pid)}\nkube-apiserver log tail:\n{_tail(log)}"

    wait_for(ready, timeout_s, "kube-apiserver /readyz", detail=detail)


def _machine_state(pid: int) -> str:
    """What a stalled start looked like from outside: the process's scheduler state (R running, S sleeping,
    D waiting on the disk), its CPU seconds, and the machine's load and free memory."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        state, cpu_s = fields[0], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        available = next(line for line in Path("/proc/meminfo").read_text().splitlines() if "MemAvailable" in line)
    except (OSError, IndexError, ValueError, StopIteration) as exc:
        return f"process {pid}: state unknown ({exc!r})"
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"process {pid}: state {state}, {cpu_s:.1f} s CPU; load average {load}; {' '.join(available.split())}"


@contextlib.contextmanager
def testenv(
    workdir: Path, start_timeout_s: float = START_TIMEOUT_S, reachable_at: Sequence[str] = ()
) -> Iterator[KubeAPI]:
    """etcd + kube-apiserver with RBAC, a static admin token (system:masters) and generated certs.

    ``start_timeout_s`` bounds each wait of the start (etcd health, each apiserver attempt's /readyz).
    ``reachable_at``: more addresses of this host the apiserver is called at (its certificate names them and it
    listens on every interface), e.g. a network namespace's peer address; ``api.server`` stays on 127.0.0.1."""
    etcd_bin, apiserver_bin = binaries()
    workdir.mkdir(parents=True, exist_ok=True)
    make_certs(workdir, reachable_at)
    token, operator_token = uuid.uuid4().hex, uuid.uuid4().hex
    (workdir / "tokens.csv").write_text(
        f'{token},lmq-admin,lmq-admin-uid,"system:masters"\n{operator_token},{OPERATOR_USER},lmq-operator-uid\n'
    )
    etcd_port, peer_port = free_port(), free_port()
    etcd_log = workdir / "etcd.log"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with etcd_log.open("wb") as out:
            procs.append(
                subprocess.Popen(
                    [
                        str(etcd_bin),
                        "--data-dir",
                        str(workdir / "etcd"),
                        "--name",
                        "default",
                        "--listen-client-urls",
                        f"http://127.0.0.1:{etcd_port}",
                        "--advertise-client-urls",
                        f"http://127.0.0.1:{etcd_port}",
                        "--listen-peer-urls",
                        f"http://127.0.0.1:{peer_port}",
                        "--initial-advertise-peer-urls",
                        f"http://127.0.0.1:{peer_port}",
                        "--initial-cluster",
                        f"default=http://127.0.0.1:{peer_port}",
                        "--unsafe-no-fsync",
                        "--log-level",
                        "warn",
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
        wait_for(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{etcd_port}/health", timeout=1).status == 200,
            start_timeout_s,
            "etcd health",
            detail=lambda: f"etcd log tail:\n{_tail(etcd_log)}",
        )
        api = KubeAPI(
            f"https://127.0.0.1:{free_port()}", token, workdir / "ca.crt", workdir / "kubeconfig", operator_token
        )
        for attempt in range(1, APISERVER_ATTEMPTS + 1):
            api_log = workdir / f"kube-apiserver-{attempt}.log"
            bind = "0.0.0.0" if reachable_at else "127.0.0.1"
            proc = _start_apiserver(apiserver_bin, workdir, etcd_port, api, api_log, bind=bind)
            procs.append(proc)
            try:
                _wait_ready(api, proc, api_log, start_timeout_s)
                break
            except (TimeoutError, RuntimeError) as exc:
                # A stalled start (seen once in CI: TLS handshakes timing out for a minute) gets one fresh
                # process on a fresh port; the first failure is logged, the second is raised.
                procs.remove(proc)
                _stop(proc, timeout_s=5.0)
                if attempt == APISERVER_ATTEMPTS:
                    raise
                logger.warning("kube-apiserver start %d of %d failed, retrying: %s", attempt, APISERVER_ATTEMPTS, exc)
                api.server = f"https://127.0.0.1:{free_port()}"
        write_kubeconfig(api, api.token, api.kubeconfig)
        wait_for(lambda: api.exists("/api/v1/namespaces/default"), start_timeout_s, "namespace default")
        yield api
    finally:
        for proc in reversed(procs):
            _stop(proc)


def write_kubeconfig(api: KubeAPI, token: str, path: Path) -> Path:
    ca = base64.b64encode(api.ca_file.read_bytes()).decode()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "testenv", "cluster": {"server": api.server, "certificate-authority-data": ca}}],
        "users": [{"name": "lmq-admin", "user": {"token": token}}],
        "contexts": [{"name": "testenv", "context": {"cluster": "testenv", "user": "lmq-admin"}}],
        "current-context": "testenv",
    }
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class OperatorProcess:
    proc: subprocess.Popen[bytes]
    log: Path
    metrics_port: int
    liveness_port: int

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        _stop(self.proc, timeout_s=15.0)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def healthz(self) -> Any:
        url = f"http://127.0.0.1:{self.liveness_port}/healthz"
        with urllib.request.urlopen(url, timeout=2) as resp:
            return json.loads(resp.read() or b"null")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as resp:
            return str(resp.read().decode())


def start_operator(api: KubeAPI, log: Path, env: Mapping[str, str], kubeconfig: Path | None = None) -> OperatorProcess:
    """``python -m lmq_operator`` against the test apiserver; waits until its liveness endpoint answers."""
    metrics_port, liveness_port = free_port(), free_port()
    full_env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig or api.kubeconfig),
        "PYTHONPATH": os.pathsep.join([str(REPO / "operator"), str(REPO / "broker")]),
        "LMQ_OPERATOR_METRICS_PORT": str(metrics_port),
        "LMQ_OPERATOR_LIVENESS_ENDPOINT": f"http://127.0.0.1:{liveness_port}/healthz",
        **env,
    }
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lmq_operator"], env=full_env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO
        )
    handle = OperatorProcess(proc, log, metrics_port, liveness_port)

    def live() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"operator exited with {proc.returncode}:\n{_tail(log)}")
        handle.healthz()
        return True

    try:
        wait_for(live, START_TIMEOUT_S, "operator liveness endpoint")
    except Exception:
        handle.stop()
        raise
    return handle


def scaling_env(namespace: str, statefulset: str, configmap: str, pods: Sequence[str]) -> dict[str, str]:
    """The operator's environment as the chart sets it for a broker StatefulSet it manages (discovery by
    EndpointSlices, the membership kept in ``configmap``), with a fast membership pass for tests."""
    return {
        "LMQ_OPERATOR_BROKER_SERVICE": statefulset,
        "LMQ_OPERATOR_BROKER_NAMESPACE": namespace,
        "LMQ_OPERATOR_BROKER_STATEFULSET": statefulset,
        "LMQ_OPERATOR_BROKER_MEMBERSHIP": configmap,
        "LMQ_OPERATOR_BROKER_ADDRESS": ",".join(pods),
        "LMQ_OPERATOR_SCALING_SECONDS": "0.5",
    }


def publish_brokers(api: KubeAPI, namespace: str, name: str, endpoints: list[tuple[str, int]], replicas: int) -> None:
    """What the chart's StatefulSet + headless Service look like to the operator: the StatefulSet object (no
    controller runs it here) and one EndpointSlice per pod ``<name>-<ordinal>`` pointing at real brokers."""
    labels = {"app": name}
    api.post(
        f"/apis/apps/v1/namespaces/{namespace}/statefulsets",
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": name},
            "spec": {
                "replicas": replicas,
                "serviceName": name,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "broker", "image": "lmq:test"}]},
                },
            },
        },
    )
    for ordinal, (ip, port) in enumerate(endpoints):
        add_broker_pod(api, namespace, name, ordinal, (ip, port))


def add_broker_pod(
    api: KubeAPI, namespace: str, name: str, ordinal: int, endpoint: tuple[str, int], *, ready: bool = True
) -> None:
    """What the EndpointSlice controller does when a new pod ``<name>-<ordinal>`` joins the headless Service (a
    scale-out): a slice for it appears, labelled with the Service's name (``ready`` False: not ready yet)."""
    ip, port = endpoint
    api.post(
        f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": f"{name}-{ordinal}", "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4",
            "ports": [{"name": "grpc", "port": port, "protocol": "TCP"}],
            "endpoints": _pod_endpoint(namespace, name, ordinal, ip, ready),
        },
    )


def _pod_endpoint(namespace: str, name: str, ordinal: int, ip: str | None, ready: bool = True) -> list[dict[str, Any]]:
    if ip is None:
        return []
    target = {"kind": "Pod", "name": f"{name}-{ordinal}", "namespace": namespace}
    return [{"addresses": [ip], "conditions": {"ready": ready}, "targetRef": target}]


def set_broker_endpoint(
    api: KubeAPI, namespace: str, name: str, ordinal: int, ip: str | None, *, ready: bool = True
) -> None:
    """What the EndpointSlice controller does when pod ``<name>-<ordinal>`` goes (``ip`` None), comes back or
    becomes ready: the slice ``publish_brokers`` made for it loses, regains or updates its endpoint."""
    path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices/{name}-{ordinal}"
    api.merge_patch(path, {"endpoints": _pod_endpoint(namespace, name, ordinal, ip, ready)})


def claim_volumes(api: KubeAPI, namespace: str, name: str, ordinals: range) -> list[str]:
    """The PersistentVolumeClaims ``data-<name>-<ordinal>`` the chart's StatefulSet leaves behind (no controller
    binds them here). Created without the pvc-protection finalizer, which only a controller would remove, so a
    delete takes them away at once, as it does in a cluster once no pod mounts them."""
    names = []
    for ordinal in ordinals:
        claim = f"data-{name}-{ordinal}"
        api.post(
            f"/api/v1/namespaces/{namespace}/persistentvolumeclaims",
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": claim, "labels": {"app": name}},
                "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
            },
        )
        api.merge_patch(
            f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claim}", {"metadata": {"finalizers": None}}
        )
        names.append(claim)
    return names
