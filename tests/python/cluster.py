"""Test helper: a real fsdp8-coordinator and fsdp8-worker daemons as child processes.

Every child gets PR_SET_PDEATHSIG(SIGKILL) (setpriv), so none outlives the test even when the test itself is
killed (ctest timeout); stop() sends SIGTERM, waits, then SIGKILL. Nothing here talks gRPC: the
tests reach the coordinator with the client they are testing.
"""
import glob
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

BIN = os.environ.get("FSDP8_BIN_DIR", os.path.join(os.path.dirname(__file__), "../../build/bin"))


# Children get SIGKILL when the test process dies (PR_SET_PDEATHSIG, kept across exec), set by
# util-linux's setpriv rather than a preexec_fn: the test process runs gRPC threads, and Python
# code between fork and exec can deadlock on a lock one of them held (the child then never execs).
DIE_WITH_PARENT = ["setpriv", "--pdeathsig", "KILL", "--"]


def fortunes_files():
    """The default corpus (Debian `fortunes`): every file but the *.dat indexes and *.u8 copies."""
    files = sorted(f for f in glob.glob("/usr/share/games/fortunes/*")
                   if os.path.isfile(f) and not f.endswith((".dat", ".u8")))
    if not files:
        raise RuntimeError("/usr/share/games/fortunes is empty: apt-get install fortunes")
    return files


class Cluster:
    """One coordinator and `workers` CPU workers. `prefix` (e.g. ["ip", "netns", "exec", "ns"])
    is put before a command to run it elsewhere; `coordinator_listen` / `worker_hosts` choose the
    addresses (loopback by default)."""

    def __init__(self, workers=2, root=None, coordinator_prefix=(), worker_prefixes=None,
                 coordinator_listen="127.0.0.1:0", coordinator_dial=None, worker_hosts=None,
                 coordinator_args=(), worker_args=()):
        self.root = root or tempfile.mkdtemp(prefix="fsdp8-test-")
        self.data = os.path.join(self.root, "data")
        os.makedirs(self.data, exist_ok=True)
        self.procs = []
        self.logs = []
        self.n_workers = workers
        self._coordinator_prefix = list(coordinator_prefix)
        self._worker_prefixes = worker_prefixes or [()] * workers
        self._listen = coordinator_listen
        self._dial = coordinator_dial
        self._worker_hosts = worker_hosts or ["127.0.0.1"] * workers
        self._coordinator_args = list(coordinator_args)
        self._worker_args = list(worker_args)
        self.address = None

    def _spawn(self, argv, name):
        log = os.path.join(self.root, name + ".log")
        with open(log, "wb") as f:
            p = subprocess.Popen(DIE_WITH_PARENT + list(argv), stdout=f, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL)
        self.procs.append(p)
        self.logs.append(log)
        return p, log

    def prepare_corpus(self, timeout=120):
        """Byte-level train.bin / val.bin under data/ with `fsdp8 prepare`."""
        subprocess.run([os.path.join(BIN, "fsdp8"), "prepare", "--out", self.data,
                        *fortunes_files()], check=True, timeout=timeout,
                       stdout=subprocess.DEVNULL)
        return os.path.join(self.data, "train.bin"), os.path.join(self.data, "val.bin")

    def start(self, timeout=30):
        """Starts the coordinator (waits for its "listening on" line), then the workers."""
        _, log = self._spawn(self._coordinator_prefix + [
            os.path.join(BIN, "fsdp8-coordinator"), "--listen=" + self._listen,
            "--state_db=" + os.path.join(self.root, "jobs.db"), "--data_roots=" + self.data,
            *self._coordinator_args], "coordinator")
        deadline = time.monotonic() + timeout
        while True:
            with open(log) as f:
                m = re.search(r"fsdp8-coordinator listening on (\S+)\n", f.read())
            if m:
                bound = m.group(1)
                break
            if self.procs[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("coordinator did not start:\n" + self.dump_logs())
            time.sleep(0.05)
        # The bound address may be 0.0.0.0:PORT; dial the given host with the bound port.
        port = bound.rsplit(":", 1)[1]
        self.address = f"{self._dial}:{port}" if self._dial else bound
        for i in range(self.n_workers):
            self._spawn(list(self._worker_prefixes[i]) + [
                os.path.join(BIN, "fsdp8-worker"), "--coordinator=" + self.address,
                "--host=" + self._worker_hosts[i], "--threads=1", *self._worker_args],
                f"worker-{i}")
        return self.address

    def stop(self, grace=5.0):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def dump_logs(self):
        out = []
        for log in self.logs:
            with open(log, errors="replace") as f:
                out.append(f"----- {log}\n" + f.read()[-4000:])
        return "\n".join(out)

    def cleanup(self, keep=False):
        self.stop()
        if not keep:
            shutil.rmtree(self.root, ignore_errors=True)
