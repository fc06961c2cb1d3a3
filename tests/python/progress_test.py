"""Progress where people look, against a real coordinator with 2 CPU workers and the real CLI:

- `import fsdp8` alone makes the SDK's documented names usable (fsdp8.v1, fsdp8.Client, the
  typed events), in a fresh interpreter; the old names keep working.
- The SDK's watch yields typed events (StepEvent, ValidationEvent, StateEvent) and writes
  TensorBoard scalars (watch(tensorboard=DIR)).
- `fsdp8 watch JOB --tensorboard DIR`, attached mid-job with its output piped: the plain lines
  carry the ETA and the last validation loss, the elapsed time counts from the job's start (not
  from the attach), and the `tensorboard` package's EventAccumulator reads back the scalars.

Expected values come from the job's own events (the raw JobEvent messages of a separate watch:
losses, learning rates, event times) and the job's start_time, not from the code under test;
TensorBoard's simple values are float32, so they are compared with numpy.float32 of the losses.
Needs the tensorboard and numpy packages (scripts/install-deps.sh installs them)."""
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

sys.path.insert(0, os.path.dirname(__file__))
import cluster  # noqa: E402

import fsdp8  # noqa: E402  (installed from client/python by the python_sdk_install test)
from fsdp8.v1 import jobs_pb2  # noqa: E402

SEQ, BATCH = 64, 4
CLI = os.path.join(cluster.BIN, "fsdp8")
# The SDK's console scripts (fsdp8-tensorboard) beside the installed package.
SDK_BIN = os.path.join(os.path.dirname(os.path.dirname(fsdp8.__file__)), "bin")
LINE = re.compile(r"^step (\d+)/(\d+) loss (\S+) val (\S+) tok/s (\d+) elapsed (\S+) ETA (\S+)"
                  r"( epoch \S+)?$")


def tiny_spec(train, val, steps, eval_every):
    return {
        "name": "progress-test", "backend": "cpu",
        "model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "ffn_dim": 192, "vocab_size": 256,
                  "seq_len": SEQ},
        "data": {"train_path": train, "val_path": val},
        "training": {"steps": steps, "global_batch": BATCH, "seed": 5, "eval_every": eval_every,
                     "eval_batches": 1},
        "sharding": {"min_workers": 2, "max_workers": 2},
    }


def seconds(text):
    """'7s', '3m12s', '1h05m' -> seconds (the CLI's duration format)."""
    m = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text)
    if not m or text == "":
        raise ValueError(f"not a duration: {text!r}")
    h, mi, s = (int(g) if g else 0 for g in m.groups())
    return 3600 * h + 60 * mi + s


def cli_env():
    path = [SDK_BIN, os.path.dirname(sys.executable), "/usr/bin", "/bin"]
    return dict(os.environ, PATH=":".join(path))


def scalars(run_dir, tag):
    acc = EventAccumulator(run_dir)
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


class ImportTest(unittest.TestCase):
    def test_import_fsdp8_alone_makes_the_documented_names_usable(self):
        code = "\n".join([
            "import fsdp8",
            "ev = fsdp8.v1.jobs_pb2.JobEvent(step=3)",       # the generated messages
            "assert fsdp8.v1.spec_pb2.JobSpec and fsdp8.v1.admin_pb2.ListWorkersRequest",
            "assert fsdp8.v1.jobs_pb2_grpc.JobServiceStub",  # the stubs
            "assert fsdp8.Client and fsdp8.load_spec and fsdp8.TERMINAL_STATES",
            "assert fsdp8.state_name(3) == 'RUNNING'",
            "assert fsdp8.client.JobState.Name(3) == 'JOB_STATE_RUNNING'",  # old names
            "assert fsdp8.State.RUNNING == fsdp8.v1.jobs_pb2.JOB_STATE_RUNNING",
            "for n in ('StepEvent', 'ValidationEvent', 'StateEvent', 'TensorBoardWriter'):",
            "    assert n in dir(fsdp8), n",
            "    getattr(fsdp8, n)",
            "print('ok')",
        ])
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.strip(), "ok")
        r = subprocess.run([sys.executable, "-c", "import fsdp8; fsdp8.nothing"],
                           capture_output=True, text=True, timeout=60)
        self.assertIn("module 'fsdp8' has no attribute 'nothing'", r.stderr)

    def test_events_say_what_they_are(self):
        nan = float("nan")
        # What the README's loop printed as "50 0.0 nan RUNNING": a notice at step 50.
        notice = fsdp8.events.from_proto(jobs_pb2.JobEvent(
            seq=53, job_id="j", state=jobs_pb2.JOB_STATE_RUNNING, step=50, total_steps=600,
            message="checkpoint step 50 committed", val_loss=nan, time=12.5))
        self.assertIsInstance(notice, fsdp8.StateEvent)
        self.assertNotIsInstance(notice, fsdp8.StepEvent)
        self.assertEqual((notice.state, notice.message, notice.step), (fsdp8.State.RUNNING,
                         "checkpoint step 50 committed", 50))
        self.assertEqual(str(notice.state), "RUNNING")
        step = fsdp8.events.from_proto(jobs_pb2.JobEvent(
            seq=54, job_id="j", state=3, step=51, total_steps=600, loss=2.5, lr=1e-3,
            grad_norm=0.75, tokens_per_second=1234.5, tokens=51 * 256, step_seconds=0.2,
            epoch=0.1, val_loss=nan, time=13.0))
        self.assertIsInstance(step, fsdp8.StepEvent)
        self.assertNotIsInstance(step, fsdp8.ValidationEvent)
        self.assertEqual((step.step, step.loss, step.lr, step.grad_norm, step.tokens_per_s,
                          step.tokens, step.time), (51, 2.5, 1e-3, 0.75, 1234.5, 51 * 256, 13.0))
        # The message's fields, as the SDK yielded them before, stay readable.
        self.assertEqual(step.tokens_per_second, 1234.5)
        self.assertTrue(math.isnan(step.val_loss))
        self.assertEqual(step.message, "")
        self.assertEqual(step.seq, 54)
        val = fsdp8.events.from_proto(jobs_pb2.JobEvent(
            seq=55, state=3, step=60, total_steps=600, loss=2.4, val_loss=2.25, eval_seconds=0.5))
        self.assertIsInstance(val, fsdp8.ValidationEvent)
        self.assertIsInstance(val, fsdp8.StepEvent)
        self.assertEqual((val.val_loss, val.eval_seconds), (2.25, 0.5))
        with self.assertRaises(AttributeError):
            step.no_such_field  # noqa: B018


class WatchProgressTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cluster = cluster.Cluster(workers=2)
        try:
            cls.train, cls.val = cls.cluster.prepare_corpus()
            cls.cluster.start()
            cls.client = fsdp8.Client(cls.cluster.address, timeout=20)
            t0 = time.monotonic()
            while len(cls.client.workers()) < 2:
                if time.monotonic() - t0 > 30:
                    raise RuntimeError("workers did not register\n" + cls.cluster.dump_logs())
                time.sleep(0.1)
        except Exception:
            cls.cluster.cleanup(keep=True)
            raise
        cls.tmp = tempfile.mkdtemp(prefix="fsdp8-progress-", dir=cls.cluster.root)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        failed = getattr(cls, "_failed", False)
        if failed:
            print(cls.cluster.dump_logs(), file=sys.stderr)
        cls.cluster.cleanup(keep=failed)

    def run(self, result=None):
        r = super().run(result)
        if result is not None and (result.failures or result.errors):
            type(self)._failed = True
        return r

    def raw_events(self, job_id):
        """The job's events as the coordinator sends them (JobEvent messages)."""
        req = jobs_pb2.WatchJobRequest(job_id=job_id)
        return list(self.client.jobs.WatchJob(req, timeout=120))

    def assertScalarsMatch(self, run_dir, raw):
        steps = [e for e in raw if not e.message and e.step > 0]
        want = {
            "train/loss": [(e.step, e.loss) for e in steps],
            "train/lr": [(e.step, e.lr) for e in steps],
            "train/grad_norm": [(e.step, e.grad_norm) for e in steps],
            "train/tokens_per_s": [(e.step, e.tokens_per_second) for e in steps],
            "val/loss": [(e.step, e.val_loss) for e in steps if not math.isnan(e.val_loss)],
        }
        self.assertTrue(want["val/loss"], "the job validated at no step")
        for tag, points in want.items():
            got = scalars(run_dir, tag)
            self.assertEqual([s for s, _ in got], [s for s, _ in points], tag)
            for (s, v), (_, w) in zip(got, points):
                self.assertEqual(v, float(np.float32(w)), f"{tag} at step {s}")

    def test_sdk_watch_yields_typed_events_and_writes_tensorboard(self):
        steps = 12
        job = self.client.submit(tiny_spec(self.train, self.val, steps, eval_every=4))
        logdir = os.path.join(self.tmp, "sdk-runs")
        events = list(self.client.watch(job.job_id, timeout=240, tensorboard=logdir))
        raw = self.raw_events(job.job_id)
        self.assertEqual([e.seq for e in events], [r.seq for r in raw])
        for ev, r in zip(events, raw):
            if r.message or r.step == 0:
                self.assertIsInstance(ev, fsdp8.StateEvent, r)
                self.assertEqual((ev.state, ev.message), (r.state, r.message))
            elif math.isnan(r.val_loss):
                self.assertIs(type(ev), fsdp8.StepEvent, r)
            else:
                self.assertIsInstance(ev, fsdp8.ValidationEvent, r)
                self.assertEqual(ev.val_loss, r.val_loss)
            if isinstance(ev, fsdp8.StepEvent):
                self.assertEqual((ev.step, ev.loss, ev.lr, ev.tokens_per_s, ev.time),
                                 (r.step, r.loss, r.lr, r.tokens_per_second, r.time))
        self.assertEqual([e.step for e in events if isinstance(e, fsdp8.StepEvent)],
                         list(range(1, steps + 1)))
        self.assertEqual(events[0].state, fsdp8.State.PENDING)
        self.assertEqual(events[-1].state, fsdp8.State.SUCCEEDED)
        self.assertTrue(events[-1].state.terminal)
        self.assertScalarsMatch(os.path.join(logdir, job.job_id), raw)

    def test_cli_watch_attached_mid_job_with_tensorboard(self):
        # Far more steps than the test waits for: it attaches once the job has run wait_s
        # seconds, follows it for watch_steps more steps (and at least 3 s), then cancels it.
        steps, wait_s, watch_steps = 20000, 6.0, 60
        job = self.client.submit(tiny_spec(self.train, self.val, steps, eval_every=10))
        try:
            self.watch_mid_job(job.job_id, steps, wait_s, watch_steps)
        finally:
            try:
                self.client.cancel(job.job_id)
            except Exception:  # noqa: BLE001  (it has ended already)
                pass

    def watch_mid_job(self, job_id, steps, wait_s, watch_steps):
        deadline = time.monotonic() + 180
        while True:
            j = self.client.get(job_id)
            if j.start_time > 0 and j.step > 0 and time.time() - j.start_time >= wait_s:
                break
            self.assertLess(time.monotonic(), deadline, "the job did not start")
            time.sleep(0.1)
        logdir = os.path.join(self.tmp, "cli-runs")
        attached = time.monotonic()
        cli = subprocess.Popen([CLI, "--coordinator", self.cluster.address, "watch", job_id,
                                "--tensorboard", logdir], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=cli_env())
        out, seen_at = [], {}  # stdout lines; step -> seconds since the attach it was read
        try:
            for line in cli.stdout:
                out.append(line.rstrip("\n"))
                m = LINE.match(out[-1])
                if m:
                    seen_at[int(m.group(1))] = time.monotonic() - attached
                    if (int(m.group(1)) >= j.step + watch_steps and seen_at[int(m.group(1))] >= 3
                            and self.client.get(job_id).state == jobs_pb2.JOB_STATE_RUNNING):
                        self.client.cancel(job_id)
            rc = cli.wait(timeout=120)
            stderr = cli.stderr.read()
        finally:
            if cli.poll() is None:
                cli.kill()
                cli.wait()
            cli.stdout.close()
            cli.stderr.close()
        stdout = "\n".join(out)
        self.assertEqual(rc, 1, stdout + stderr)  # the job was cancelled
        final = self.client.get(job_id)
        self.assertEqual(final.state, jobs_pb2.JOB_STATE_CANCELLED)
        raw = self.raw_events(job_id)
        by_step = {e.step: e for e in raw if not e.message and e.step > 0}
        lines = [LINE.match(x) for x in out if x.startswith("step ")]
        self.assertTrue(lines and all(lines), stdout)
        self.assertGreater(int(lines[-1].group(1)), j.step, stdout)  # steps after the attach
        for m in lines:
            step = int(m.group(1))
            self.assertEqual(int(m.group(2)), steps)
            ev = by_step[step]
            self.assertEqual(m.group(3), f"{ev.loss:.4f}", m.group(0))
            # The last validation loss so far, also on the lines of steps that did not validate.
            vals = [e.val_loss for s, e in sorted(by_step.items())
                    if s <= step and not math.isnan(e.val_loss)]
            self.assertEqual(m.group(4), f"{vals[-1]:.4f}" if vals else "-", m.group(0))
            # Elapsed: the job's own, at the step's time (whole seconds, so within a second).
            self.assertLessEqual(abs(seconds(m.group(6)) - (ev.time - final.start_time)), 1.0,
                                 m.group(0))
            # ETA: the steps left at a per-step time between the fastest and slowest step so far
            # (whole seconds; whole minutes past an hour).
            left = steps - step
            st = [e.step_seconds for s, e in by_step.items() if s <= step and e.step_seconds > 0]
            eta, slack = seconds(m.group(7)), 60 if "h" in m.group(7) else 1
            self.assertGreaterEqual(eta, min(st) * left - slack, m.group(0))
            self.assertLessEqual(eta, max(st) * left + slack, m.group(0))
            # Attached mid-job: lines read after the attach show more elapsed time than has
            # passed since the attach (by about wait_s, the job's time before it; a line may
            # reach the test up to 4 s after its step, and elapsed is rounded to seconds).
            if step > j.step:
                self.assertGreater(seconds(m.group(6)), seen_at[step] + 1.5, m.group(0))
        self.assertTrue(any(v for v in vals), "no line after a validation")
        run_dir = os.path.join(logdir, job_id)
        self.assertIn(f"tensorboard: {len(by_step)} steps written to {run_dir}", stdout)
        self.assertScalarsMatch(run_dir, raw)

    def test_cli_writer_that_cannot_start_stops_the_watch_first(self):
        # A fsdp8-tensorboard that fails as a missing tensorboard package would: the CLI says so
        # before it watches anything (an unknown job would otherwise fail NOT_FOUND, exit 1).
        fake = os.path.join(self.tmp, "failingbin")
        os.makedirs(fake, exist_ok=True)
        script = os.path.join(fake, "fsdp8-tensorboard")
        with open(script, "w") as f:
            f.write("#!/bin/sh\necho 'fsdp8-tensorboard: no tensorboard here' >&2\nexit 3\n")
        os.chmod(script, 0o755)
        r = subprocess.run([CLI, "--coordinator", self.cluster.address, "watch", "no-such-job",
                            "--tensorboard", os.path.join(self.tmp, "never")],
                           capture_output=True, text=True, env=dict(os.environ, PATH=fake),
                           timeout=60)
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertIn("fsdp8-tensorboard: no tensorboard here", r.stderr)
        self.assertIn("stopped before writing anything (exit status 3)", r.stderr)
        self.assertNotIn("NOT_FOUND", r.stderr)

    def test_cli_without_the_writer_submits_nothing(self):
        before = [j.job_id for j in self.client.list()]
        spec = os.path.join(self.tmp, "job.yaml")
        import yaml
        with open(spec, "w") as f:
            yaml.safe_dump(tiny_spec(self.train, self.val, 5, eval_every=0), f)
        empty = os.path.join(self.tmp, "emptybin")
        os.makedirs(empty, exist_ok=True)
        r = subprocess.run([CLI, "--coordinator", self.cluster.address, "submit", spec,
                            "--tensorboard", os.path.join(self.tmp, "never")],
                           capture_output=True, text=True, env=dict(os.environ, PATH=empty),
                           timeout=60)
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertIn("fsdp8-tensorboard (fsdp8's Python SDK) is not on PATH", r.stderr)
        self.assertIn("python3 -m pip install './client/python[tensorboard]'", r.stderr)
        self.assertEqual([j.job_id for j in self.client.list()], before)
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "never")))


if __name__ == "__main__":
    unittest.main(verbosity=2)
