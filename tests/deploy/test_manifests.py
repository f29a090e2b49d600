"""deploy/k8s renders with `kubectl kustomize` and validates against the Kubernetes 1.32 schemas (kubernetes-validate,
strict), and what the manifests say agrees with the server: its flags parse with bps-server's own parser, the probes
and the Prometheus annotations name its metrics port, the grace period covers its drain. The JobSet's Jobs are
validated as batch/v1 Jobs (the JobSet CRD's own schema is not in kubernetes-validate)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.helpers import REPO
from torch_bps.server.cli import parse_args

pytestmark = pytest.mark.timeout(120)

K8S = os.path.join(REPO, "deploy", "k8s")
KUBERNETES_VERSION = "1.32.0"  # docs/deploy.md names it; kubectl here is 1.32
KUSTOMIZATIONS = ["base", "overlays/dev", "overlays/production", "examples/jobset"]

yaml = pytest.importorskip("yaml", reason="PyYAML is missing: `make deploy-check` installs it (kubernetes-validate)")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is missing: `make deploy-check` installs it"
)


def render(folder: str) -> list[dict]:
    """`kubectl kustomize deploy/k8s/FOLDER`, parsed."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is missing (Debian: apt-get install kubectl; `make deploy-check` installs it)")
    out = subprocess.run(["kubectl", "kustomize", os.path.join(K8S, folder)], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def jobset_jobs(jobset: dict) -> list[dict]:
    """The Jobs a JobSet makes, as batch/v1 Job objects (one per replicated job)."""
    return [{"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"{jobset['metadata']['name']}-{r['name']}"},
             "spec": r["template"]["spec"]} for r in jobset["spec"]["replicatedJobs"]]  # fmt: skip


def validate(doc: dict) -> None:
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {e.message} at {list(e.path)}")


@pytest.mark.parametrize("folder", KUSTOMIZATIONS)
def test_renders_and_validates(folder):
    docs = render(folder)
    assert docs, f"{folder} rendered nothing"
    for doc in docs:
        if doc["kind"] == "JobSet":
            assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
            for job in jobset_jobs(doc):
                validate(job)
        else:
            validate(doc)


def server_pods(docs: list[dict]) -> list[dict]:
    """Every pod template in `docs` that runs bps-server."""
    pods = []
    for doc in docs:
        if doc["kind"] == "StatefulSet":
            pods.append(doc["spec"]["template"])
        elif doc["kind"] == "JobSet":
            pods += [j["spec"]["template"] for j in jobset_jobs(doc)]
    return [p for p in pods if p["spec"]["containers"][0]["name"] == "bps-server"]


@pytest.mark.parametrize("folder", KUSTOMIZATIONS)
def test_server_pods_agree_with_bps_server(folder, tmp_path):
    pods = server_pods(render(folder))
    assert pods, f"{folder} runs no bps-server"
    for pod in pods:
        spec, (container,) = pod["spec"], pod["spec"]["containers"]
        credential = tmp_path / "credential"
        credential.write_text("a-pool-credential\n")
        flags = [
            f"--credential-file={credential}" if a.startswith("--credential-file=") else a for a in container["args"]
        ]
        args = parse_args(flags)  # exits (SystemExit) on a flag bps-server does not know
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"push-pull": args.port, "metrics": args.metrics_port}
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        annotations = pod["metadata"]["annotations"]
        assert (
            annotations["prometheus.io/scrape"] == "true"
            and int(annotations["prometheus.io/port"]) == args.metrics_port
        )
        assert spec["terminationGracePeriodSeconds"] > args.drain_timeout, "SIGKILL would cut the drain short"
        secret = next(v["secret"] for v in spec["volumes"] if v["name"] == "credential")
        mount = next(m for m in container["volumeMounts"] if m["name"] == "credential")
        assert secret["secretName"] == "bps-pool-credential"
        assert os.path.join(mount["mountPath"], secret["items"][0]["path"]) == "/etc/bps/credential"
        assert spec["securityContext"]["runAsNonRoot"] and container["securityContext"]["readOnlyRootFilesystem"]
        assert "memory" in container["resources"]["limits"], "the memory bound defaults to half the limit"


def test_headless_service_names_the_server_ports():
    docs = render("base")
    (service,) = [d for d in docs if d["kind"] == "Service"]
    (statefulset,) = [d for d in docs if d["kind"] == "StatefulSet"]
    assert service["spec"]["clusterIP"] == "None" and statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"push-pull", "metrics"}


@pytest.mark.parametrize("folder", ["base", "overlays/dev", "overlays/production"])
def test_every_selector_picks_the_server_pods(folder):
    """The Service, the StatefulSet and the PodDisruptionBudget select the servers' pods (a budget with no selector
    would cover every pod of the namespace)."""
    docs = render(folder)
    (statefulset,) = [d for d in docs if d["kind"] == "StatefulSet"]
    labels = statefulset["spec"]["template"]["metadata"]["labels"]
    selectors = {d["kind"]: d["spec"]["selector"] for d in docs if d["kind"] != "StatefulSet"}
    selectors["StatefulSet"] = statefulset["spec"]["selector"]
    assert selectors.keys() == {"Service", "StatefulSet", "PodDisruptionBudget"}
    for kind, selector in selectors.items():
        match = selector.get("matchLabels", selector) if kind != "Service" else selector
        assert match and match.items() <= labels.items(), f"{kind} selects {match}, the pods are {labels}"


def test_jobset_workers_name_the_jobsets_servers():
    (jobset,) = render("examples/jobset")
    name, subdomain = jobset["metadata"]["name"], jobset["spec"]["network"]["subdomain"]
    jobs = {r["name"]: r for r in jobset["spec"]["replicatedJobs"]}
    servers = jobs["server"]["template"]["spec"]["parallelism"]
    # JobSet's pod host names: JOBSET-REPLICATEDJOB-JOBINDEX-PODINDEX under the subdomain.
    expected = [f"{name}-server-0-{i}.{subdomain}:9000" for i in range(servers)]
    (trainer,) = jobs["node"]["template"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in trainer["env"]}
    assert env["BPS_SERVERS"]["value"].split(",") == expected
    assert env["BPS_POOL_CREDENTIAL"]["valueFrom"]["secretKeyRef"] == {
        "name": "bps-pool-credential",
        "key": "credential",
    }
    nodes = jobs["node"]["template"]["spec"]["parallelism"]
    assert (
        f"--nnodes={nodes}" in trainer["args"]
        and f"--rdzv-endpoint={name}-node-0-0.{subdomain}:29500" in trainer["args"]
    )
