"""Plays deploy/k8s/overlays/cpu-dev with `podman kube play` and trains on it.

Renders the overlay with `kubectl kustomize`, translates what podman 4.3 lacks (below), plays the
coordinator and the CPU workers from the images deploy/build-images.sh built, then, from a client
outside the pods (a container on the host's network, dialing the published port):
  1. runs every container's rendered gRPC probes (port, service) against its pod: SERVING;
  2. submits the default job (data/default-job.yaml; FSDP8_DEPLOY_STEPS steps) and waits for
     SUCCEEDED with its checkpoints on the shared volume;
  3. submits the default job with min_workers 1 and a checkpoint every 10 steps, runs a worker's
     preStop hook (`podman exec`) and stops that worker (`podman stop`, SIGTERM) mid-job: the job
     resumes on the remaining worker; then kills the coordinator's container (SIGKILL) and starts
     its pod again (podman stops it with its last container) on its volume: the job resumes; it
     ends SUCCEEDED. The times are printed.
Everything it made (pods, the client, volumes, the network unless it existed, the secret directory)
is removed on exit, also on failure and on SIGTERM, and nothing else: what it made is listed in
FSDP8_DEPLOY_DIR/kube-play-made.json as it goes, which the next run reads if this one is killed.
Exit code 0: passed; 1: failed.

The translation (podman 4.3 plays Pods, Deployments, PersistentVolumeClaims and ConfigMaps; every
container's image, command, arguments, environment, mounts, ports and probes stay as rendered):
  - Namespace fsdp8-dev: a podman network of that name; each pod gets a fixed address in it.
  - Service fsdp8-coordinator: a hostAliases entry `fsdp8-coordinator` -> the coordinator pod's
    address in every pod (cluster DNS); the client outside the pods dials the hostPort of the
    coordinator's `grpc` port (what a port-forward gives). The headless Service fsdp8-worker is
    dropped (nothing dials it by name).
  - Container ports: podman 4.3 publishes every containerPort on the host at the same number
    (Kubernetes publishes none; two workers would collide): each gets a free hostPort on
    127.0.0.1, the containerPort unchanged.
  - StatefulSet fsdp8-worker: its replicas as Pods fsdp8-worker-0..N-1 of the same pod template.
  - Downward API `status.podIP`: the pod's fixed address (podman 4.3 refuses that fieldPath).
  - `$(VAR)` in command and args: expanded from the container's env, as the kubelet does (podman
    4.3 passes them on literally).
  - Secret volumes (podman 4.3 crashes on them) and ConfigMap volumes mounted with subPath (podman
    4.3 ignores subPath): hostPath directories and files holding the same keys.
  - PodDisruptionBudget, NetworkPolicy: dropped (podman enforces neither; the test takes one worker
    at a time, as the budget allows). gRPC probes: podman 4.3 ignores them; step 1 runs them.
Environment: FSDP8_PODMAN (the podman command, default `podman --runtime runc`), KUBECTL,
FSDP8_DEPLOY_DIR (work directory), FSDP8_DEPLOY_STEPS (default 600), FSDP8_DEPLOY_PORT (host port
for the coordinator, default: a free one), FSDP8_DEPLOY_NETWORK (default fsdp8-dev; networks are
shared by every podman store on the host)."""
import base64
import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import grpc
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERLAY = os.path.join(ROOT, "deploy/k8s/overlays/cpu-dev")
PODMAN = shlex.split(os.environ.get("FSDP8_PODMAN", "podman --runtime runc"))
WORK = os.path.abspath(os.environ.get("FSDP8_DEPLOY_DIR", os.path.join(ROOT, "build-deploy")))
STEPS = int(os.environ.get("FSDP8_DEPLOY_STEPS", "600"))
NETWORK = os.environ.get("FSDP8_DEPLOY_NETWORK", "fsdp8-dev")  # the Namespace's network
CLIENT = f"fsdp8-dev-client-{os.getpid()}"
# What this run made (pods, containers, volumes, the network when it was not there), written as it
# goes so that teardown, in this run or after an interrupted one, removes that and nothing else.
MADE = os.path.join(WORK, "kube-play-made.json")
SERVING = 1


def log(msg):
    print(f"[kube_play {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def podman(*args, check=True, timeout=600, quiet=False):
    r = subprocess.run(PODMAN + list(args), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)}: exit {r.returncode}\n{r.stdout}{r.stderr}")
    return r.stdout if not quiet else r


# ---- the translation ------------------------------------------------------------------------

def render():
    kubectl = os.environ.get("KUBECTL", "kubectl")
    out = subprocess.run([kubectl, "kustomize", OVERLAY], check=True, capture_output=True,
                         text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def expand(text, env):
    """$(VAR) -> env[VAR] for defined VARs, $$(VAR) -> $(VAR): the kubelet's expansion."""
    def sub(m):
        if m.group(0).startswith("$$"):
            return m.group(0)[1:]
        return env.get(m.group(1), m.group(0))
    return re.sub(r"\$?\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, text)


def container_env(c, configmaps, pod_name, pod_ip):
    """The values the kubelet would give the container's env (for $(VAR) expansion), and the env
    with `status.podIP` replaced by the pod's address."""
    values, env = {}, []
    for e in c.get("env", []):
        src = e.get("valueFrom", {})
        if "fieldRef" in src and src["fieldRef"]["fieldPath"] == "status.podIP":
            e = {"name": e["name"], "value": pod_ip}
        if "value" in e:
            values[e["name"]] = expand(e["value"], values)
        elif "configMapKeyRef" in src:
            ref = src["configMapKeyRef"]
            values[e["name"]] = configmaps[ref["name"]]["data"][ref["key"]]
        elif src.get("fieldRef", {}).get("fieldPath") == "metadata.name":
            values[e["name"]] = pod_name
        env.append(e)
    return values, env


def host_volumes(spec, objs, pod_name):
    """Secret volumes and subPath ConfigMap mounts -> hostPath (files written under WORK)."""
    secrets = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Secret"}
    configmaps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap"}
    uid = spec.get("securityContext", {}).get("runAsUser", 0)
    gid = spec.get("securityContext", {}).get("fsGroup", uid)
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for v in spec.get("volumes", []):
        if "secret" in v:
            d = os.path.join(WORK, "volumes", pod_name, v["name"])
            os.makedirs(d, exist_ok=True)
            mode = v["secret"].get("defaultMode", 0o644) | 0o040  # group-readable: fsGroup
            secret = secrets[v["secret"]["secretName"]]
            keys = {k: base64.b64decode(val) for k, val in secret.get("data", {}).items()}
            keys.update({k: val.encode() for k, val in secret.get("stringData", {}).items()})
            for k, val in keys.items():
                p = os.path.join(d, k)
                with open(p, "wb") as f:
                    f.write(val)
                os.chmod(p, mode)
                os.chown(p, uid, gid)
            volumes[v["name"]] = {"name": v["name"],
                                  "hostPath": {"path": d, "type": "Directory"}}
    for c in spec["containers"]:
        for m in c.get("volumeMounts", []):
            v = volumes.get(m["name"], {})
            if "subPath" not in m or "configMap" not in v:
                continue
            name = f"{m['name']}-{m['subPath'].replace('.', '-')}"
            p = os.path.join(WORK, "volumes", pod_name, m["subPath"])
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "w") as f:
                f.write(configmaps[v["configMap"]["name"]]["data"][m["subPath"]])
            os.chmod(p, 0o644)
            volumes[name] = {"name": name, "hostPath": {"path": p, "type": "File"}}
            m["name"] = name
            del m["subPath"]
    spec["volumes"] = list(volumes.values())


def translate_pod(template, objs, pod_name, pod_ip, aliases):
    """One pod's spec, translated; `template` is the rendered pod template (copied)."""
    t = yaml.safe_load(yaml.safe_dump(template))
    spec = t["spec"]
    configmaps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap"}
    for c in spec["containers"]:
        values, c["env"] = container_env(c, configmaps, pod_name, pod_ip)
        for key in ("command", "args"):
            if key in c:
                c[key] = [expand(a, values) for a in c[key]]
    host_volumes(spec, objs, pod_name)
    spec["hostAliases"] = aliases
    for c in spec["containers"]:
        for p in c.get("ports", []):
            p["hostIP"], p["hostPort"] = "127.0.0.1", free_port()
    return t


def translate(objs, ips, host_port):
    """Rendered objects -> {"volumes": [PVC...], "pods": [(name, ip, [docs])]}."""
    by_kind = {}
    for o in objs:
        by_kind.setdefault(o["kind"], []).append(o)
    configmaps = [{k: o[k] for k in ("apiVersion", "kind", "data")} |
                  {"metadata": {"name": o["metadata"]["name"]}} for o in by_kind["ConfigMap"]]
    pvcs = [dict(o, metadata={"name": o["metadata"]["name"]})
            for o in by_kind["PersistentVolumeClaim"]]
    coord = next(d for d in by_kind["Deployment"] if d["metadata"]["name"] == "fsdp8-coordinator")
    aliases = [{"ip": ips[0], "hostnames": ["fsdp8-coordinator"]}]
    pods = []
    cname = coord["metadata"]["name"]
    t = translate_pod(coord["spec"]["template"], objs, cname, ips[0], aliases)
    for p in t["spec"]["containers"][0]["ports"]:
        if p["name"] == "grpc":
            p["hostPort"] = host_port
            FREE_PORTS_TAKEN.add(host_port)
    pods.append((cname, ips[0], configmaps + [{
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": cname},
        "spec": dict(coord["spec"], template=t)}]))
    sts = next(s for s in by_kind["StatefulSet"] if s["metadata"]["name"] == "fsdp8-worker")
    for i in range(sts["spec"]["replicas"]):
        name = f"{sts['metadata']['name']}-{i}"
        t = translate_pod(sts["spec"]["template"], objs, name, ips[1 + i], aliases)
        pods.append((name, ips[1 + i], configmaps + [{
            "apiVersion": "v1", "kind": "Pod",
            "metadata": dict(t.get("metadata", {}), name=name), "spec": t["spec"]}]))
    return {"volumes": pvcs, "pods": pods}


# ---- playing and tearing down ---------------------------------------------------------------

def made():
    try:
        with open(MADE) as f:
            return json.load(f)
    except FileNotFoundError:
        return {"pods": [], "containers": [], "volumes": [], "networks": []}


def record(kind, names):
    """Adds `names` to what this run made (kind: pods, containers, volumes or networks)."""
    m = made()
    m[kind] += [n for n in names if n not in m[kind]]
    with open(MADE + ".tmp", "w") as f:
        json.dump(m, f)
    os.replace(MADE + ".tmp", MADE)


def teardown():
    """Removes what this run, or an interrupted earlier one with the same FSDP8_DEPLOY_DIR, made
    (MADE): its pods with their containers, its containers, volumes and network. Idempotent."""
    m = made()
    for name in m["pods"]:
        podman("pod", "rm", "-f", "-t", "0", name, check=False, quiet=True)
    for name in m["containers"]:
        podman("rm", "-f", "-t", "0", name, check=False, quiet=True)
    for name in m["volumes"]:
        podman("volume", "rm", "-f", name, check=False, quiet=True)
    for name in m["networks"]:
        podman("network", "rm", "-f", name, check=False, quiet=True)
    if os.path.exists(MADE):
        os.remove(MADE)
    subprocess.run(["rm", "-rf", os.path.join(WORK, "volumes")], check=False)


def listed(*args):
    return set(podman(*args, "--format", "{{.Name}}").split())


def kube_play(path, docs, *args):
    """`podman kube play` of `docs` (written to `path`), recording the pods and volumes it made:
    those new since before the play and named in the docs (other users of the store may add
    theirs meanwhile). A volume of a claim in the docs that exists already is refused: the test
    would run on its data, and it is not the test's to remove."""
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    pods_before, volumes_before = listed("pod", "ps"), listed("volume", "ls")
    taken = claims & volumes_before
    if taken:
        raise RuntimeError(f"volume(s) {sorted(taken)} exist and were not made by this run: "
                           "remove them, or set FSDP8_PODMAN_ROOT (a podman store of its own)")
    with open(path, "w") as f:
        yaml.safe_dump_all(docs, f, sort_keys=False)
    names = {d["metadata"]["name"] for d in docs}
    for d in docs:
        spec = d.get("spec", {})
        spec = spec.get("template", {}).get("spec", spec)
        names |= {v["name"] for v in spec.get("volumes", [])}
        names |= {v["persistentVolumeClaim"]["claimName"] for v in spec.get("volumes", [])
                  if "persistentVolumeClaim" in v}
    try:
        podman("kube", "play", "--network", NETWORK, *args, path)
    finally:
        record("pods", [p for p in listed("pod", "ps") - pods_before
                        if any(p == n or re.fullmatch(re.escape(n) + r"-pod(-\d+)?", p)
                               for n in names)])
        record("volumes", sorted((listed("volume", "ls") - volumes_before) & names))


def pod_addresses(n):
    """The network (made, unless it exists) and n fixed addresses in its subnet (.10, .11, ...)."""
    if podman("network", "exists", NETWORK, check=False, quiet=True).returncode != 0:
        podman("network", "create", NETWORK)
        record("networks", [NETWORK])
    else:
        log(f"network {NETWORK} exists: used, and kept at the end")
    info = json.loads(podman("network", "inspect", NETWORK))[0]
    subnet = info["subnets"][0]["subnet"]
    base = subnet.split("/")[0].rsplit(".", 1)[0]
    return [f"{base}.{10 + i}" for i in range(n)]


FREE_PORTS_TAKEN = set()


def free_port():
    """A port free on the host, below the ephemeral range, not handed out before."""
    rng = random.Random(os.getpid() ^ int(time.time() * 1000))
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        if port in FREE_PORTS_TAKEN:
            continue
        FREE_PORTS_TAKEN.add(port)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def mac_of(ip):
    """A locally administered MAC address made of the pod's IPv4 address (0a:58:<the 4 bytes>, as
    Kubernetes' bridge plugins make theirs)."""
    return "0a:58:" + ":".join(f"{int(b):02x}" for b in ip.split("."))


def play(name, ip, docs):
    """Plays a pod at a fixed IP and MAC address: where the kubelet restarts a container inside the
    pod's running sandbox (its network namespace, address and MAC kept), podman starts the whole pod
    again, with a new MAC unless it is pinned; its peers would then send to the old MAC until their
    neighbour entry expires (15-45 s) and not reach the restarted coordinator meanwhile."""
    path = os.path.join(WORK, f"play-{name}.yaml")
    kube_play(path, docs, "--ip", ip, "--mac-address", mac_of(ip))
    log(f"played {name} at {ip}, MAC {mac_of(ip)} ({path})")


def pod_of(name):
    """The podman pod that kube play made for a Pod or Deployment `name`."""
    pods = podman("pod", "ps", "--format", "{{.Name}}").split()
    for p in pods:
        if p == name or re.fullmatch(re.escape(name) + r"-pod(-\d+)?", p):
            return p
    raise RuntimeError(f"no pod for {name} among {pods}")


def container_of(pod, container):
    return f"{pod}-{container}"


def logs(name):
    r = podman("logs", "--tail", "40", name, check=False, quiet=True)
    return f"--- {name}\n{r.stdout}{r.stderr}"


# ---- the probes -----------------------------------------------------------------------------

def health(addr, service, timeout=5):
    """grpc.health.v1.Health/Check, request and response in protobuf wire format by hand
    (HealthCheckRequest: field 1 `service`; HealthCheckResponse: field 1 `status`, SERVING = 1)."""
    req = b"" if not service else b"\x0a" + bytes([len(service)]) + service.encode()
    with grpc.insecure_channel(addr) as ch:
        rpc = ch.unary_unary("/grpc.health.v1.Health/Check",
                             request_serializer=lambda b: b, response_deserializer=lambda b: b)
        resp = rpc(req, timeout=timeout)
    return 0 if resp == b"" else resp[1]


def probes(docs):
    """(container, kind, port, service) of every rendered gRPC probe in a played pod's docs."""
    workload = docs[-1]
    spec = workload["spec"]["template"]["spec"] if workload["kind"] == "Deployment" \
        else workload["spec"]
    out = []
    for c in spec["containers"]:
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            g = c.get(kind, {}).get("grpc")
            if g:
                out.append((c["name"], kind, g["port"], g.get("service", "")))
    return out


def wait_probes_serving(plan, deadline_s=120):
    """Every probe of every pod SERVING (the kubelet's view); returns the lines to print."""
    t0 = time.monotonic()
    lines = []
    for name, ip, docs in plan["pods"]:
        for container, kind, port, service in probes(docs):
            while True:
                try:
                    status = health(f"{ip}:{port}", service)
                except grpc.RpcError as e:
                    status = e.code().name
                if status == SERVING:
                    break
                if time.monotonic() - t0 > deadline_s:
                    raise RuntimeError(f"{name}/{container} {kind} {ip}:{port} service "
                                       f"'{service}': {status}, not SERVING")
                time.sleep(1)
            lines.append(f"{name}/{container} {kind} grpc {ip}:{port} service '{service}': "
                         "SERVING")
    return lines


# ---- the client outside the pods ------------------------------------------------------------

class Client:
    """The fsdp8 CLI of the coordinator image in a container on the host's network, dialing the
    coordinator's published port."""

    def __init__(self, image, port):
        self.addr = f"127.0.0.1:{port}"
        record("containers", [CLIENT])  # a name of this run's own
        podman("run", "-d", "--name", CLIENT, "--network", "host", "--entrypoint", "/bin/sleep",
               "-v", f"{WORK}:{WORK}:ro", image, "infinity")

    def run(self, *args, check=True, timeout=120):
        r = podman("exec", CLIENT, "/usr/local/bin/fsdp8", "--coordinator", self.addr, *args,
                   check=False, quiet=True, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"fsdp8 {' '.join(args)}: exit {r.returncode}\n{r.stdout}{r.stderr}")
        return r

    def status(self, job):
        r = self.run("status", job, "--json", check=False, timeout=30)
        try:
            return json.loads(r.stdout) if r.returncode == 0 else {}
        except json.JSONDecodeError:
            return {}

    def wait(self, job, what, cond, timeout_s, pods=()):
        t0 = time.monotonic()
        while True:
            j = self.status(job)
            if j and cond(j):
                return j
            if j.get("state") in ("JOB_STATE_FAILED", "JOB_STATE_CANCELLED"):
                raise RuntimeError(f"{job} {j['state']} waiting for {what}: {j.get('reason')}\n" +
                                   "".join(logs(p) for p in pods))
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"{job}: no {what} in {timeout_s} s: {j}\n" +
                                   "".join(logs(p) for p in pods))
            time.sleep(0.5)


def step(j):
    return int(j.get("step", 0))


def job_spec(name, steps, ckpt, extra=None):
    with open(os.path.join(ROOT, "data/default-job.yaml")) as f:
        spec = yaml.safe_load(f.read().replace("DATA_DIR", "/data/fortunes"))
    spec["name"] = name
    spec["training"]["steps"] = steps
    spec["training"]["eval_every"] = min(spec["training"]["eval_every"], steps)
    spec["checkpoint"] = {"dir": ckpt}
    for key, val in (extra or {}).items():
        spec.setdefault(key, {}).update(val)
    path = os.path.join(WORK, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(spec, f, sort_keys=False)
    os.chmod(path, 0o644)
    return path


def committed_on_volume(ckpt):
    """Steps with a MANIFEST under ckpt (a path inside the volume fsdp8-data), read on the host."""
    mount = podman("volume", "inspect", "fsdp8-data", "--format", "{{.Mountpoint}}").strip()
    d = os.path.join(mount, os.path.relpath(ckpt, "/data"))
    if not os.path.isdir(d):
        return []
    return sorted(int(s.split("-")[1]) for s in os.listdir(d)
                  if s.startswith("step-") and os.path.isfile(os.path.join(d, s, "MANIFEST")))


def prepare_corpus(image):
    """The fortunes corpus -> /data/fortunes on the shared volume (scripts/prepare-fortunes.sh in
    the image, as the image's user)."""
    src = "/usr/share/games/fortunes"
    if not os.path.isdir(src):
        raise RuntimeError(f"{src} missing (apt-get install fortunes)")
    name = f"fsdp8-dev-corpus-{os.getpid()}"
    record("containers", [name])  # removed by teardown if this run is killed meanwhile
    podman("run", "--rm", "--name", name, "-v", "fsdp8-data:/data", "-v", f"{src}:{src}:ro",
           "-v", f"{ROOT}/scripts:/opt/fsdp8-scripts:ro", "--entrypoint", "/bin/bash", image,
           "/opt/fsdp8-scripts/prepare-fortunes.sh", "/usr/local/bin/fsdp8", "/data/fortunes")


# ---- the scenario ---------------------------------------------------------------------------

def default_job(client, pods):
    ckpt = "/data/checkpoints/default"
    spec = job_spec("fortunes-default", STEPS, ckpt)
    t0 = time.monotonic()
    job = client.run("submit", spec, "--no-watch").stdout.split()[0]
    log(f"submitted the default job ({STEPS} steps) through {client.addr}: {job}")
    j = client.wait(job, "SUCCEEDED", lambda j: j["state"] == "JOB_STATE_SUCCEEDED",
                    300 + 10 * STEPS, pods)
    took = time.monotonic() - t0
    steps = committed_on_volume(ckpt)
    if STEPS not in steps:
        raise RuntimeError(f"no committed checkpoint of step {STEPS} on fsdp8-data:{ckpt}: "
                           f"{steps}")
    log(f"default job SUCCEEDED in {took:.0f} s, final loss "
        f"{j.get('loss')}, val {j.get('val_loss')}; checkpoints on fsdp8-data:{ckpt}: {steps}")
    return took


def worker_prestop_and_stop(client, job, plan, coord_pod):
    """Worker 1's preStop hook, then SIGTERM: the job goes on on worker 0."""
    name, _, docs = plan["pods"][2]
    spec = docs[-1]["spec"]
    c = spec["containers"][0]
    ctr = container_of(name, c["name"])
    j = client.wait(job, "2 ranks past step 12",
                    lambda j: j.get("world_size") == 2 and step(j) >= 12, 300, [ctr])
    t0 = time.monotonic()
    podman("exec", ctr, *c["lifecycle"]["preStop"]["exec"]["command"], timeout=300)
    t_prestop = time.monotonic() - t0
    podman("stop", "-t", str(spec["terminationGracePeriodSeconds"]), ctr, timeout=400)
    t_stop = time.monotonic() - t0
    committed = committed_on_volume("/data/checkpoints/faults")
    if not committed or max(committed) < step(j):
        raise RuntimeError(f"preStop returned without a checkpoint after step {step(j)}: "
                           f"{committed}")
    ck = max(committed)
    j = client.wait(job, "1 rank past the preStop checkpoint",
                    lambda j: j["state"] == "JOB_STATE_RUNNING" and j.get("world_size") == 1
                    and step(j) > ck, 300, [coord_pod])
    t_resumed = time.monotonic() - t0
    log(f"worker preStop + stop at step {ck}: preStop {t_prestop:.1f} s (checkpoint step {ck} "
        f"committed), stopped after {t_stop:.1f} s, the job ran again on 1 worker (step "
        f"{step(j)}) {t_resumed:.1f} s after the preStop began")
    return t_prestop, t_resumed


def pod_stopped(pod, timeout_s=20):
    """Waits until every container of `pod` has stopped, or timeout_s: a pod kube play made stops
    when its last container exits (its exit policy), infra container included."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if podman("pod", "inspect", pod, "--format", "{{.State}}").strip() in ("Exited", "Stopped"):
            return
        time.sleep(0.2)


def coordinator_kill_and_start(client, job, coord_pod, coord_ctr, pods):
    """SIGKILL to the coordinator's container 10 steps later, then start it again (what the
    kubelet does after a crash): same pod, address and volume fsdp8-coordinator-db. The kubelet
    restarts the container in the pod's running sandbox; podman stops the whole pod once the
    container is gone (kube play's exit policy), so the pod is started again, once it has stopped
    (starting the container alone races with that). The workers hold the job meanwhile and the new
    coordinator re-adopts them (no restart counted, no checkpoint read), or, when it cannot,
    resumes the job from its checkpoint (a restart counted); the log says which, with the times
    from the kill and from the new coordinator's start (`podman pod start` returned)."""
    s0 = step(client.status(job))
    j = client.wait(job, "10 more steps", lambda j: step(j) >= s0 + 10, 600, pods)
    s_kill, r_kill = step(j), int(j.get("restarts", 0))
    t0 = time.monotonic()
    podman("kill", "-s", "KILL", coord_ctr)
    pod_stopped(coord_pod)
    podman("pod", "start", coord_pod)
    t_start = time.monotonic()

    # Only the new coordinator answers (the old one is dead): the job ran again when it is RUNNING
    # (re-adopted, or resumed from its checkpoint), or it has SUCCEEDED; its steps left after the
    # restart may all run between two polls.
    def again(j):
        return j["state"] in ("JOB_STATE_RUNNING", "JOB_STATE_SUCCEEDED")
    j = client.wait(job, "the job running again", again, 300, pods)
    t_answer = time.monotonic() - t0
    t_answer_start = time.monotonic() - t_start
    s_back, state_back = step(j), j["state"].removeprefix("JOB_STATE_")
    how = ("re-adopted, no checkpoint read" if int(j.get("restarts", 0)) == r_kill else
           "resumed from its checkpoint")
    j = client.wait(job, "a step after the restart",
                    lambda j: again(j) and (step(j) > s_back or
                                            j["state"] == "JOB_STATE_SUCCEEDED"), 300, pods)
    t_step = time.monotonic() - t0
    t_step_start = time.monotonic() - t_start
    log(f"coordinator SIGKILLed at step {s_kill} and started again: the job {state_back} at step "
        f"{s_back} ({how}) after {t_answer:.1f} s, step {step(j)} after {t_step:.1f} s; from the "
        f"new coordinator's start: {state_back} after {t_answer_start:.1f} s, next step after "
        f"{t_step_start:.1f} s")
    return t_answer_start, t_step_start


def faults(client, plan):
    coord_name, _, _ = plan["pods"][0]
    coord_pod = pod_of(coord_name)
    coord_ctr = container_of(coord_pod, "coordinator")
    pods = [coord_ctr, container_of(plan["pods"][1][0], "worker")]
    steps = int(os.environ.get("FSDP8_DEPLOY_FAULT_STEPS", "120"))
    spec = job_spec("fortunes-faults", steps, "/data/checkpoints/faults",
                    {"sharding": {"min_workers": 1, "max_workers": 2},
                     "checkpoint": {"every_steps": 10}})
    job = client.run("submit", spec, "--no-watch").stdout.split()[0]
    log(f"submitted the fault job ({steps} steps, min_workers 1, a checkpoint every 10): {job}")
    times = worker_prestop_and_stop(client, job, plan, coord_ctr)
    times += coordinator_kill_and_start(client, job, coord_pod, coord_ctr, pods)
    j = client.wait(job, "SUCCEEDED", lambda j: j["state"] == "JOB_STATE_SUCCEEDED",
                    300 + 10 * steps, pods)
    log(f"fault job SUCCEEDED at step {step(j)}, generation {j.get('generation')}; committed "
        f"checkpoints {committed_on_volume('/data/checkpoints/faults')}")
    return times


def main():
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM: tear down
    os.makedirs(WORK, exist_ok=True)
    objs = render()
    coord_image = next(o for o in objs if o["kind"] == "Deployment")[
        "spec"]["template"]["spec"]["containers"][0]["image"]
    teardown()
    plan = None
    try:
        n_workers = next(o for o in objs if o["kind"] == "StatefulSet")["spec"]["replicas"]
        ips = pod_addresses(1 + n_workers)
        port = int(os.environ.get("FSDP8_DEPLOY_PORT", "0")) or free_port()
        plan = translate(objs, ips, port)
        # --network: without it kube play makes podman-default-kube-network, even for volumes.
        kube_play(os.path.join(WORK, "play-volumes.yaml"), plan["volumes"])
        t0 = time.monotonic()
        prepare_corpus(coord_image)
        log(f"fortunes corpus on fsdp8-data:/data/fortunes ({time.monotonic() - t0:.0f} s)")
        t0 = time.monotonic()
        for name, ip, docs in plan["pods"]:
            play(name, ip, docs)
        client = Client(coord_image, port)
        names = [container_of(pod_of(plan["pods"][0][0]), "coordinator")] + \
            [container_of(n, "worker") for n, _, _ in plan["pods"][1:]]
        for line in wait_probes_serving(plan):
            log(line)
        log(f"pods up, every probe SERVING, {time.monotonic() - t0:.0f} s after the first play")
        rows = client.run("workers").stdout
        if sum(1 for r in rows.splitlines() if " cpu " in r) < n_workers:
            raise RuntimeError(f"not every worker registered:\n{rows}" +
                               "".join(logs(n) for n in names))
        t_default = default_job(client, names)
        t_prestop, t_worker, t_coord_answer, t_coord_step = faults(client, plan)
        log(f"SUMMARY default job {t_default:.0f} s; worker preStop {t_prestop:.1f} s, resumed on "
            f"1 worker after {t_worker:.1f} s; coordinator restart: job RUNNING "
            f"{t_coord_answer:.1f} s and next step {t_coord_step:.1f} s after the new "
            f"coordinator's start")
        return 0
    except Exception as e:  # noqa: BLE001 - reported, then the exit code says it
        log(f"FAILED: {e}")
        return 1
    finally:
        if os.environ.get("FSDP8_DEPLOY_KEEP") != "1":
            teardown()


if __name__ == "__main__":
    sys.exit(main())
