"""Kubernetes manifests render with kustomize, validate against the Kubernetes
schemas offline, and agree with the cxlkv configuration they ship."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import tomllib

import pytest
import yaml

from cxlkv_testkit import containerfile
from conftest import BIN, ROOT, VENV_BIN

OVERLAYS = sorted(p for p in (ROOT / "deploy" / "kubernetes" / "overlays").iterdir() if p.is_dir())
KUSTOMIZATIONS = OVERLAYS + [ROOT / "deploy" / "lmcache"]


def render(path: pathlib.Path) -> list[dict]:
    out = subprocess.run([str(VENV_BIN / "kubectl"), "kustomize", str(path)], capture_output=True, text=True,
                         check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def one(docs, kind, name_prefix=""):
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name_prefix)]
    assert len(found) == 1, f"expected one {kind} {name_prefix}*, got {len(found)}"
    return found[0]


def port_of(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1])


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(ROOT)))
def test_renders_and_validates_offline(path, tmp_path):
    docs = render(path)
    assert docs
    f = tmp_path / "rendered.yaml"
    f.write_text(yaml.safe_dump_all(docs))
    out = subprocess.run([str(VENV_BIN / "kubernetes-validate"), "--strict", str(f)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    # Only the Prometheus Operator CRD lacks a schema; it is checked below.
    assert "fail" not in out.stdout.lower(), out.stdout


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_manifests_match_the_config_they_ship(overlay, tmp_path):
    docs = render(overlay)
    cm = one(docs, "ConfigMap", "cxlkv-config")
    text = cm["data"]["cxlkv.toml"]
    conf = tmp_path / "cxlkv.toml"
    conf.write_text(text)
    check = subprocess.run([BIN, "config", str(conf)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr  # the sidecar accepts it
    cfg = tomllib.loads(check.stdout)
    ds = one(docs, "DaemonSet", "cxlkv")
    pod = ds["spec"]["template"]["spec"]
    c = pod["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["metrics"] == port_of(cfg["server"]["metrics_addr"])
    assert ports["grpc"] == port_of(cfg["server"]["tcp_addr"])
    assert c["livenessProbe"]["httpGet"] == {"path": "/live", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "metrics"}
    assert c["startupProbe"]["httpGet"]["port"] == "metrics"
    assert pod["terminationGracePeriodSeconds"] * 1000 > cfg["server"]["shutdown_grace_ms"]

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
    config_arg = c["args"][c["args"].index("--config") + 1]
    assert mounts[str(pathlib.PurePath(config_arg).parent)]["configMap"]["name"] == cm["metadata"]["name"]
    sock_dir = str(pathlib.PurePath(cfg["server"]["socket"]).parent)
    assert mounts[sock_dir]["hostPath"]["path"] == sock_dir, "socket directory must be shared with the host"
    pool = cfg["pool"]["path"]
    sc = c["securityContext"]
    if cfg["pool"]["backend"] == "shm":
        v = mounts[str(pathlib.PurePath(pool).parent)]
        assert v["hostPath"]["type"] == "Directory"
        limit = c["resources"]["limits"]["memory"]
        assert limit.endswith("Mi") and int(limit[:-2]) << 20 > cfg["pool"]["size"], \
            "prefaulted shm pages count against the memory limit"
        assert sc["runAsNonRoot"] is True and not sc.get("privileged")
    else:
        assert mounts[pool]["hostPath"] == {"path": pool, "type": "CharDevice"}
        assert sc["privileged"] is True
        assert sc["runAsUser"] == 0, "a DAX node is root's"
    check_against_the_containerfile(pod, c, cfg, mounts)

    svc = one(docs, "Service", "cxlkv-peers")
    assert svc["spec"]["clusterIP"] == "None"
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= set(ports)
    assert svc["spec"]["selector"].items() <= pod_labels(ds).items()
    pm = one(docs, "PodMonitor", "cxlkv")
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels(ds).items()
    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == ["metrics"]
    assert pm["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"


def check_against_the_containerfile(pod, c, cfg, mounts):
    img = containerfile.image("runtime")
    ci = containerfile.image("prebuilt")
    assert (ci.user, ci.entrypoint, ci.cmd, ci.expose) == (img.user, img.entrypoint, img.cmd, img.expose), \
        "what CI builds must run like the release image"
    # The container runs the image's entrypoint (`cxlkv serve`) with the
    # manifest's arguments, which name the config path the image defaults to.
    assert "command" not in c, "the image's ENTRYPOINT is `cxlkv serve`"
    argv = img.entrypoint + c["args"]
    assert argv[:2] == ["/usr/local/bin/cxlkv", "serve"]
    assert c["args"] == img.cmd, "manifest and image default to the same config path"
    config_dir = str(pathlib.PurePath(img.cmd[img.cmd.index("--config") + 1]).parent)
    assert "configMap" in mounts[config_dir]
    assert {p["containerPort"] for p in c["ports"]} == img.expose
    # The image's user owns the socket directory: in the image (COPY --chown)
    # and on the host (the init container hands the hostPath over).
    uid, gid = img.user
    sock_dir = str(pathlib.PurePath(cfg["server"]["socket"]).parent)
    chowned = [cp for cp in img.copies if f"--chown={uid}:{gid}" in cp]
    assert [cp[-1].rstrip("/") for cp in chowned] == [sock_dir]
    sc = c["securityContext"]
    assert sc["runAsGroup"] == gid
    assert sc["runAsUser"] in (uid, 0)
    assert sc["readOnlyRootFilesystem"] is True, "the sidecar writes only to its mounts"
    [init] = [i for i in pod["initContainers"] if i["name"] == "socket-dir"]
    assert init["command"] == ["chown", f"{uid}:{gid}", sock_dir]
    [m] = init["volumeMounts"]
    assert m["mountPath"] == sock_dir and mounts[sock_dir] == next(v for v in pod["volumes"] if v["name"] == m["name"])


def test_the_image_is_named_once_and_tagged_with_the_crate_version():
    version = tomllib.loads((ROOT / "Cargo.toml").read_text())["package"]["version"]
    images = {i["name"]: i for i in yaml.safe_load(
        (ROOT / "deploy" / "kubernetes" / "base" / "kustomization.yaml").read_text())["images"]}
    ref = f"{images['cxlkv']['newName']}:{version}"
    assert images["cxlkv"]["newTag"] == version
    for overlay in OVERLAYS:
        ds = one(render(overlay), "DaemonSet", "cxlkv")
        assert ds["spec"]["template"]["spec"]["containers"][0]["image"] == ref
    named = [p for p in (ROOT / "deploy").rglob("*") if p.is_file() and images["cxlkv"]["newName"] in p.read_text()]
    assert named == [ROOT / "deploy" / "kubernetes" / "base" / "kustomization.yaml"]
    out = subprocess.run(["bash", str(ROOT / "scripts" / "build-image.sh"), "--print-ref"], capture_output=True,
                         text=True, check=True, env={k: v for k, v in os.environ.items() if k != "IMAGE"})
    assert out.stdout.strip() == ref


def test_ci_and_release_images_share_the_layout():
    st = containerfile.stages()
    assert st["prebuilt"].base == st["runtime"].base == "meta"
    assert "cargo build --release --locked --bin cxlkv" in st["build"].last("RUN")
    assert "scripts/image-rootfs.sh target/release/cxlkv /rootfs" in st["build"].last("RUN")
    script = (ROOT / "scripts" / "build-image.sh").read_text()
    assert "cargo build --release --locked --bin cxlkv" in script
    assert "scripts/image-rootfs.sh target/release/cxlkv target/image-rootfs" in script
    # The same files, from the build stage or from the staged rootfs.
    release = [[a for a in cp if a != "--from=build"] for cp in containerfile.image("runtime").copies]
    staged = containerfile.image("prebuilt").copies
    assert [[a.replace("target/image-rootfs/", "/rootfs/") for a in cp] for cp in staged] == release
    # The image's default config is the shipped Kubernetes one.
    img = containerfile.image("runtime")
    assert (f'"$here/deploy/kubernetes/base/cxlkv.toml" "$out{img.cmd[img.cmd.index("--config") + 1]}"'
            in (ROOT / "scripts" / "image-rootfs.sh").read_text())
    assert f"uid={img.user[0]}" in (ROOT / "scripts" / "image-rootfs.sh").read_text()


def pod_labels(ds):
    return ds["spec"]["template"]["metadata"]["labels"]


def test_lmcache_example_reaches_the_sidecar_it_is_deployed_with():
    cfg = tomllib.loads((ROOT / "deploy" / "kubernetes" / "base" / "cxlkv.toml").read_text())
    ds = one(render(ROOT / "deploy" / "lmcache"), "DaemonSet", "lmcache-server")
    pod = ds["spec"]["template"]["spec"]
    c = pod["containers"][0]
    arg = next(a for a in c["args"] if a.startswith("--l2-adapter="))
    spec = json.loads(arg.split("=", 1)[1])
    assert (spec["type"], spec["module_path"], spec["class_name"]) == ("plugin", "cxlkv_lmcache.adapter",
                                                                       "CxlKvL2Adapter")
    assert spec["adapter_params"]["socket"] == cfg["server"]["socket"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
    sock_dir = str(pathlib.PurePath(cfg["server"]["socket"]).parent)
    assert mounts[sock_dir]["hostPath"]["path"] == sock_dir
    pool_dir = str(pathlib.PurePath(cfg["pool"]["path"]).parent)
    assert mounts[pool_dir]["hostPath"]["path"] == pool_dir, "zero-copy needs the pool mounted"
    # Socket and pool are 0660, group of the sidecar image's user.
    assert containerfile.image().user[1] in pod["securityContext"]["supplementalGroups"]
    # The adapter accepts these parameters.
    from cxlkv_lmcache.adapter import CxlKvL2AdapterConfig
    CxlKvL2AdapterConfig.from_dict(spec["adapter_params"])


def test_dashboard_uses_only_documented_metrics():
    doc = (ROOT / "docs" / "METRICS.md").read_text()
    documented = set(re.findall(r"^\| `(cxlkv_[a-z_]+)`", doc, re.M))
    dash = json.loads((ROOT / "deploy" / "grafana" / "cxlkv-dashboard.json").read_text())
    used = set()
    for p in dash["panels"]:
        for t in p["targets"]:
            used |= {re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"cxlkv_[a-z_]+", t["expr"])}
    assert used and used <= documented, used - documented


def election_calls() -> set[str]:
    """The RBAC verbs of the calls the kubernetes election makes: each one
    goes through ApiLeases::call, named by its verb."""
    return set(re.findall(r'self\.call\("(\w+)"', (ROOT / "src" / "election" / "apiserver.rs").read_text()))


def accepted_config(text: str, tmp_path) -> dict:
    conf = tmp_path / "cxlkv.toml"
    conf.write_text(text)
    check = subprocess.run([BIN, "config", str(conf)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    return tomllib.loads(check.stdout)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_the_role_grants_the_election_its_calls_and_no_more(overlay, tmp_path):
    docs = render(overlay)
    text = one(docs, "ConfigMap", "cxlkv-config")["data"]["cxlkv.toml"]
    # The shipped config with the election switched on (the dax overlay's
    # recipe; node name and peer address come from the DaemonSet's args).
    elected = text + '\n[cluster]\nelection = "kubernetes"\nnode_name = "worker-1"\npeer_addr = "10.0.0.7:50052"\n'
    cfg = accepted_config(elected, tmp_path)
    assert cfg["cluster"]["election"] == "kubernetes"
    assert cfg["cluster"]["lease_namespace"] == "", "the Lease lives in the service account's namespace"
    calls = election_calls()
    assert calls == {"get", "create", "update"}, calls
    granted = {}
    for rule in one(docs, "Role", "cxlkv-election")["rules"]:
        assert (rule["apiGroups"], rule["resources"]) == (["coordination.k8s.io"], ["leases"]), rule
        for verb in rule["verbs"]:
            assert verb not in granted, f"{verb} granted twice"
            granted[verb] = rule.get("resourceNames")
    assert set(granted) == calls
    # Every call on an existing Lease is limited to the election's Lease;
    # create cannot be (the object has no name yet when it is authorised).
    for verb, names in granted.items():
        assert names == (None if verb == "create" else [cfg["cluster"]["election_name"]]), verb


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_the_sidecar_runs_as_the_service_account_the_role_is_bound_to(overlay):
    docs = render(overlay)
    ds = one(docs, "DaemonSet", "cxlkv")
    pod = ds["spec"]["template"]["spec"]
    sa, role, rb = one(docs, "ServiceAccount", "cxlkv"), one(docs, "Role"), one(docs, "RoleBinding")
    ns = ds["metadata"]["namespace"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    assert pod.get("automountServiceAccountToken", True) and sa.get("automountServiceAccountToken", True), \
        "the election reads the mounted token"
    assert sa["metadata"]["namespace"] == role["metadata"]["namespace"] == rb["metadata"]["namespace"] == ns
    assert rb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]}
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": ns}]
    # The node's identity (cluster.node_name) and the address it advertises
    # (cluster.peer_addr) come from the downward API; the peer port is on
    # the headless Service.
    c = pod["containers"][0]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"] if "fieldRef" in e.get("valueFrom", {})}
    assert env["CXLKV_NODE_NAME"] == "spec.nodeName"
    assert env["CXLKV_POD_IP"] == "status.podIP"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    svc = one(docs, "Service", "cxlkv-peers")
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]}["peer"] == (ports["peer"], "peer")
