#!/usr/bin/env python3
"""Renders every overlay of deploy/k8s with `kubectl kustomize`, validates every object against the
Kubernetes OpenAPI schemas (kubernetes-validate, strict: unknown fields are errors) of the oldest
and newest versions we support, and checks what the deployment relies on:

- coordinator: Deployment + Service (gRPC port) + its own ReadWriteOnce volume holding --state_db;
- a ReadWriteMany volume mounted at --data_roots by the coordinator and every worker;
- workers: StatefulSet under a headless Service, nvidia.com/gpu: 1 (GPU overlays), /dev/shm a memory
  emptyDir, native gRPC readiness/liveness probes on --health_port, preStop drain script from the
  ConfigMap, PodDisruptionBudget; a Secret mounted by both; NetworkPolicies keeping the workers'
  traffic between workers (plus the coordinator and DNS);
- every --flag in a container's args exists in that binary's --helpfull (FSDP8_BIN_DIR), and every
  $(VAR) it uses is defined in the container's env.

usage: check.py [OVERLAY...]   (default: every folder of deploy/k8s/overlays)
env: KUBECTL (default kubectl), FSDP8_BIN_DIR (default build/bin).
"""
import copy
import os
import re
import subprocess
import sys

import kubernetes_validate
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.environ.get("FSDP8_BIN_DIR", os.path.join(HERE, "../../build/bin"))
VERSIONS = ["1.27.0", "1.37.0"]  # native gRPC probes are GA from 1.27
errors = []


def fail(overlay, msg):
    errors.append(f"{overlay}: {msg}")


def render(overlay):
    kubectl = os.environ.get("KUBECTL", "kubectl")
    r = subprocess.run([kubectl, "kustomize", os.path.join(HERE, "overlays", overlay)],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise SystemExit(f"{overlay}: {kubectl} kustomize failed:\n{r.stderr}")
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def validate(overlay, objs):
    for v in VERSIONS:
        for o in objs:
            try:
                kubernetes_validate.validate(o, v, strict=True)
            except kubernetes_validate.ValidationError as e:
                fail(overlay, f"{o['kind']}/{o['metadata']['name']} invalid for {v}: "
                     f"{'.'.join(str(p) for p in e.path)}: {e.message}")


def validator_rejects_mistakes():
    """The validator is not a no-op: a misspelled field and a wrong type are refused."""
    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "x"},
           "spec": {"serviceName": "x", "selector": {"matchLabels": {"a": "b"}},
                    "template": {"metadata": {"labels": {"a": "b"}},
                                 "spec": {"containers": [{"name": "c", "image": "i"}]}}}}
    kubernetes_validate.validate(sts, VERSIONS[-1], strict=True)
    for mutate in (lambda s: s["spec"].__setitem__("replica", 2),
                   lambda s: s["spec"]["template"]["spec"]["containers"][0].__setitem__(
                       "readinessProbe", {"grpc": {"port": "health"}})):
        bad = copy.deepcopy(sts)
        mutate(bad)
        try:
            kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)
            fail("validator", f"accepted {bad}")
        except kubernetes_validate.ValidationError:
            pass


def helpfull(binary, cache={}):
    if binary not in cache:
        r = subprocess.run([os.path.join(BIN, binary), "--helpfull"], capture_output=True,
                           text=True, timeout=30)
        cache[binary] = set(re.findall(r"^\s+--(\w+)", r.stdout + r.stderr, re.M))
        if not cache[binary]:
            raise SystemExit(f"no flags from {BIN}/{binary} --helpfull (build it first)")
    return cache[binary]


def flag(args, name):
    for a in args:
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    return None


def selects(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def check(overlay, objs):
    by = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    get = lambda kind, name: by.get((kind, name)) or fail(overlay, f"no {kind}/{name}")  # noqa
    cm = get("ConfigMap", "fsdp8-config")
    secret = get("Secret", "fsdp8-auth")
    data_pvc = get("PersistentVolumeClaim", "fsdp8-data")
    db_pvc = get("PersistentVolumeClaim", "fsdp8-coordinator-db")
    dep = get("Deployment", "fsdp8-coordinator")
    svc = get("Service", "fsdp8-coordinator")
    sts = get("StatefulSet", "fsdp8-worker")
    if None in (cm, secret, data_pvc, db_pvc, dep, svc, sts):
        return
    if data_pvc["spec"]["accessModes"] != ["ReadWriteMany"]:
        fail(overlay, "fsdp8-data must be ReadWriteMany")
    data_roots = cm["data"]["data_roots"]

    def pod_checks(workload, binary):
        spec = workload["spec"]["template"]["spec"]
        if not selects(workload["spec"]["selector"]["matchLabels"],
                       workload["spec"]["template"]["metadata"]["labels"]):
            fail(overlay, f"{workload['metadata']['name']}: selector does not match its pods")
        vols = {v["name"]: v for v in spec["volumes"]}
        (c,) = spec["containers"]
        if c["command"] != [f"/usr/local/bin/{binary}"]:
            fail(overlay, f"{binary}: command {c['command']}")
        env = {e["name"]: e for e in c.get("env", [])}
        for a in c["args"]:
            m = re.match(r"--(\w+)=", a)
            if not m or m.group(1) not in helpfull(binary):
                fail(overlay, f"{binary}: {a!r} is not a flag of {binary}")
            for var in re.findall(r"\$\((\w+)\)", a):
                if var not in env:
                    fail(overlay, f"{binary}: {a!r} uses $({var}), not in env")
        for e in env.values():
            ref = e.get("valueFrom", {}).get("configMapKeyRef")
            if ref and (ref["name"] != "fsdp8-config" or ref["key"] not in cm["data"]):
                fail(overlay, f"{binary}: env {e['name']} names a missing ConfigMap key")
        mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
        vol_of = lambda path: vols.get(mounts[path]["name"]) if path in mounts else None  # noqa
        d = vol_of(data_roots)
        if not d or d.get("persistentVolumeClaim", {}).get("claimName") != "fsdp8-data":
            fail(overlay, f"{binary}: the data volume is not mounted at {data_roots}")
        a = vol_of("/etc/fsdp8/auth")
        if not a or a.get("secret", {}).get("secretName") != "fsdp8-auth":
            fail(overlay, f"{binary}: fsdp8-auth not mounted at /etc/fsdp8/auth")
        return spec, c, env, mounts, vols

    # Coordinator.
    spec, c, env, mounts, vols = pod_checks(dep, "fsdp8-coordinator")
    listen_port = int(flag(c["args"], "listen").rsplit(":", 1)[1])
    db_dir = os.path.dirname(flag(c["args"], "state_db"))
    if vols.get(mounts.get(db_dir, {}).get("name"), {}).get(
            "persistentVolumeClaim", {}).get("claimName") != "fsdp8-coordinator-db":
        fail(overlay, f"coordinator: {db_dir} (--state_db) is not on fsdp8-coordinator-db")
    if db_pvc["spec"]["accessModes"] != ["ReadWriteOnce"] or dep["spec"]["replicas"] != 1 or \
            dep["spec"]["strategy"]["type"] != "Recreate":
        fail(overlay, "coordinator: one replica, Recreate, its db ReadWriteOnce")
    drain = float(flag(c["args"], "drain_timeout_s") or 60)
    if spec.get("terminationGracePeriodSeconds", 30) <= drain:
        fail(overlay, f"coordinator: grace period <= --drain_timeout_s {drain}")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    if ports.get("grpc") != listen_port:
        fail(overlay, f"coordinator: port grpc {ports.get('grpc')} != --listen {listen_port}")
    for probe in ("readinessProbe", "livenessProbe"):
        if c.get(probe, {}).get("grpc", {}).get("port") != listen_port:
            fail(overlay, f"coordinator: {probe} is not a gRPC probe on {listen_port}")
    metrics = int(flag(c["args"], "metrics_port") or 0)
    if not metrics or ports.get("metrics") != metrics:
        fail(overlay, f"coordinator: port metrics {ports.get('metrics')} != --metrics_port {metrics}")
    if not selects(svc["spec"]["selector"], dep["spec"]["template"]["metadata"]["labels"]) or \
            {(p["name"], p["targetPort"]) for p in svc["spec"]["ports"]} != {
                ("grpc", "grpc"), ("metrics", "metrics")}:
        fail(overlay, "Service fsdp8-coordinator does not reach the coordinator's grpc and "
             "metrics ports")
    svc_port = [p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc"][0]

    # Workers.
    spec, c, env, mounts, vols = pod_checks(sts, "fsdp8-worker")
    headless = by.get(("Service", sts["spec"]["serviceName"]))
    labels = sts["spec"]["template"]["metadata"]["labels"]
    if not headless or headless["spec"].get("clusterIP") != "None" or \
            not selects(headless["spec"]["selector"], labels):
        fail(overlay, "workers: serviceName is not a headless Service selecting them")
    coord = flag(c["args"], "coordinator")
    coord = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)].get("value", ""), coord)
    if coord != f"fsdp8-coordinator:{svc_port}":
        fail(overlay, f"workers: --coordinator {coord} is not the Service fsdp8-coordinator")
    if flag(c["args"], "host") != "$(POD_IP)" or \
            env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] != "status.podIP":
        fail(overlay, "workers: --host must be the pod IP (peers dial it)")
    if flag(c["args"], "name") != "$(POD_NAME)" or \
            env.get("POD_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != \
            "metadata.name":
        fail(overlay, "workers: --name must be the pod name (the StatefulSet's stable worker id)")
    health = int(flag(c["args"], "health_port") or 0)
    wmetrics = int(flag(c["args"], "metrics_port") or 0)
    wports = {p["name"]: p["containerPort"] for p in c["ports"]}
    if not health or not wmetrics or wports != {"health": health, "metrics": wmetrics}:
        fail(overlay, f"workers: container ports {wports} != --health_port {health}, "
             f"--metrics_port {wmetrics}")
    if c["readinessProbe"].get("grpc") != {"port": health, "service": "ready"} or \
            c["livenessProbe"].get("grpc") != {"port": health}:
        fail(overlay, f"workers: probes must be gRPC on {health} (readiness service \"ready\")")
    shm = vols.get(mounts.get("/dev/shm", {}).get("name"), {}).get("emptyDir", {})
    if shm.get("medium") != "Memory":
        fail(overlay, "workers: /dev/shm is not a memory emptyDir")
    pre = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    script = pre[-1] if pre else ""
    m = mounts.get(script)
    if not m or vols[m["name"]].get("configMap", {}).get("name") != "fsdp8-config" or \
            m.get("subPath") not in cm["data"]:
        fail(overlay, f"workers: preStop {pre} is not a script of the ConfigMap")
    else:
        r = subprocess.run(["sh", "-n"], input=cm["data"][m["subPath"]], text=True,
                           capture_output=True, timeout=10)
        if r.returncode != 0:
            fail(overlay, f"preStop script: sh -n: {r.stderr}")
    gpu = flag(c["args"], "backend") == "cuda"
    for kind in ("requests", "limits"):
        want = "1" if gpu else None
        got = c["resources"].get(kind, {}).get("nvidia.com/gpu")
        if (str(got) if got is not None else None) != want:
            fail(overlay, f"workers: resources.{kind} nvidia.com/gpu {got}, want {want}")
    pdb = [o for o in objs if o["kind"] == "PodDisruptionBudget"
           and selects(o["spec"]["selector"]["matchLabels"], labels)]
    if len(pdb) != 1:
        fail(overlay, "workers: want exactly one PodDisruptionBudget")

    # NetworkPolicy: workers talk to workers; besides, only the health and metrics ports in,
    # coordinator and DNS out.
    pols = [o for o in objs if o["kind"] == "NetworkPolicy"
            and selects(o["spec"]["podSelector"].get("matchLabels", {}), labels)]
    if len(pols) != 1 or sorted(pols[0]["spec"]["policyTypes"]) != ["Egress", "Ingress"]:
        fail(overlay, "workers: want one NetworkPolicy with Ingress and Egress")
        return
    worker_peer = [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "fsdp8-worker"}}}]
    for rule in pols[0]["spec"]["ingress"]:
        if rule.get("from") != worker_peer and \
                not (rule.get("from") is None and rule.get("ports") == [
                    {"port": health, "protocol": "TCP"}, {"port": wmetrics, "protocol": "TCP"}]):
            fail(overlay, f"workers: ingress rule admits more than workers: {rule}")
    coord_labels = dep["spec"]["template"]["metadata"]["labels"]
    for rule in pols[0]["spec"]["egress"]:
        to = rule.get("to")
        if to == worker_peer:
            continue
        if to and len(to) == 1 and selects(to[0]["podSelector"]["matchLabels"], coord_labels) \
                and rule.get("ports") == [{"port": listen_port, "protocol": "TCP"}]:
            continue
        if to is None and all(p["port"] == 53 for p in rule.get("ports", [])) and rule.get("ports"):
            continue
        fail(overlay, f"workers: egress rule lets traffic leave the job: {rule}")


def main():
    overlays = sys.argv[1:] or sorted(os.listdir(os.path.join(HERE, "overlays")))
    validator_rejects_mistakes()
    for ov in overlays:
        objs = render(ov)
        validate(ov, objs)
        check(ov, objs)
        print(f"{ov}: {len(objs)} objects: " +
              ", ".join(sorted(f"{o['kind']}/{o['metadata']['name']}" for o in objs)))
    for e in errors:
        print("FAIL", e)
    print(f"{len(overlays) - len({e.split(':')[0] for e in errors})} passed, "
          f"{len({e.split(':')[0] for e in errors})} failed")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
