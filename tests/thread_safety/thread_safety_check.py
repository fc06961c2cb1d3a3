#!/usr/bin/env python3
"""Clang's thread-safety analysis over fsdp8's own C++ sources.

Every C++ source of the checked directories (coordinator/, worker/, train/, comm/, common/) that
the CMake build compiles is compiled again, syntax only, by clang++ with -Wthread-safety -Werror
and the include paths and definitions of its entry in BUILD/compile_commands.json. A member declared ABSL_GUARDED_BY(mu_) read or written without mu_
held, a ...Locked helper (ABSL_EXCLUSIVE_LOCKS_REQUIRED) called without its lock, or a lock not
released on some path is then an error naming the file, the line and the mutex. CUDA sources
(.cu) are not compiled: clang would need the CUDA toolkit's device headers; none of them holds a
mutex of these directories. client/ holds no mutex and is not compiled (clang refuses one of its
absl::StrFormat calls, whose format string is chosen at run time, which gcc accepts).
-Wno-c++20-extensions: the sources capture `[=, this]`, which gcc accepts in C++17 without a
word and clang calls a C++20 extension; no other warning is turned off.

--drop-lock FILE:FUNCTION checks the check: it compiles FILE with the first absl::MutexLock line
inside FUNCTION's body removed (a copy in a temporary directory; the tree is not touched) and
succeeds only when clang then fails with a thread-safety error about that function's mutex.

Exit status: 0 when the check passed (or, with --drop-lock, failed as expected); 1 otherwise;
2 for a usage error or a build directory without compile_commands.json.
"""

import argparse
import concurrent.futures
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

CHECKED_DIRS = ("coordinator", "worker", "train", "comm", "common")
# Directories that must contribute sources: the libraries the check exists for.
REQUIRED_DIRS = ("coordinator", "worker", "train", "comm")
SOURCE_SUFFIXES = (".cc", ".cpp", ".cxx")
LAUNCHERS = {"ccache", "sccache", "distcc"}
# Flags kept from the build's command, with the ones that take a separate argument.
KEPT_WITH_ARG = {"-I", "-isystem", "-iquote", "-idirafter", "-include", "-D", "-U"}
KEPT_PREFIXES = ("-I", "-isystem", "-iquote", "-idirafter", "-D", "-U", "-std=")
CLANG_FLAGS = ["-fsyntax-only", "-Wthread-safety", "-Werror", "-Wno-c++20-extensions"]
MUTEX_LOCK = re.compile(r"^\s*absl::(?:Mutex|WriterMutex|ReaderMutex|ReleasableMutex)Lock\s+\w+\(")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build-dir", required=True, help="CMake build directory")
    p.add_argument("--source-dir", required=True, help="the fsdp8 checkout")
    p.add_argument("--clang", default="clang++", help="clang++ to run")
    p.add_argument("--jobs", type=int, default=0, help="parallel compiles (0: the CPU count)")
    p.add_argument("--drop-lock", metavar="FILE:FUNCTION",
                   help="expect a failure once FUNCTION's first absl::MutexLock is removed")
    p.add_argument("files", nargs="*", help="only these sources (paths relative to the tree)")
    return p.parse_args()


def load_entries(build_dir, source_dir):
    """The compile_commands.json entries of the checked C++ sources, by path relative to the tree."""
    path = os.path.join(build_dir, "compile_commands.json")
    try:
        with open(path) as f:
            entries = json.load(f)
    except OSError as e:
        print(f"thread_safety_check: {path}: {e.strerror} (configure with CMake first: "
              "scripts/build.sh)")
        sys.exit(2)
    root = os.path.realpath(source_dir)
    out = {}
    for e in entries:
        file = os.path.realpath(os.path.join(e.get("directory", ""), e["file"]))
        rel = os.path.relpath(file, root)
        if rel.startswith("..") or not rel.endswith(SOURCE_SUFFIXES):
            continue
        if rel.split(os.sep)[0] in CHECKED_DIRS:
            out[rel] = e
    return out


def clang_command(entry, clang, file):
    """clang++ -fsyntax-only with the entry's include paths, definitions and language standard."""
    args = entry["arguments"] if "arguments" in entry else shlex.split(entry["command"])
    i = 0
    while i < len(args) and os.path.basename(args[i]) in LAUNCHERS:
        i += 1
    args = args[i + 1:]  # after the compiler
    kept = []
    i = 0
    while i < len(args):
        a = args[i]
        if a in KEPT_WITH_ARG and i + 1 < len(args):
            kept += [a, args[i + 1]]
            i += 2
            continue
        if a.startswith(KEPT_PREFIXES) or a == "-pthread":
            kept.append(a)
        i += 1
    return [clang] + CLANG_FLAGS + kept + [file], entry.get("directory") or None


def compile_one(cmd, cwd):
    r = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return r.returncode, r.stdout


def check_all(entries, clang, jobs, only):
    missing = [d for d in REQUIRED_DIRS if not any(rel.startswith(d + os.sep) for rel in entries)]
    if only:
        unknown = [f for f in only if f not in entries]
        if unknown:
            print(f"thread_safety_check: not checked sources: {', '.join(unknown)}")
            return 2
        entries = {rel: e for rel, e in entries.items() if rel in only}
    elif missing:
        print(f"thread_safety_check: no sources of {', '.join(missing)} in compile_commands.json")
        return 1
    t0 = time.monotonic()
    failed = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {}
        for rel, e in sorted(entries.items()):
            cmd, cwd = clang_command(e, clang, os.path.join(e.get("directory", ""), e["file"]))
            futures[pool.submit(compile_one, cmd, cwd)] = (rel, cmd)
        for fut in concurrent.futures.as_completed(futures):
            rel, cmd = futures[fut]
            rc, out = fut.result()
            if rc != 0:
                failed.append(rel)
                print(f"FAILED: {rel}\n  {shlex.join(cmd)}\n{out}", flush=True)
    dirs = sorted({rel.split(os.sep)[0] for rel in entries})
    print(f"thread_safety_check: {len(entries)} sources of {', '.join(dirs)} compiled by {clang} "
          f"{' '.join(CLANG_FLAGS)} in {time.monotonic() - t0:.1f} s; {len(failed)} failed"
          + (f": {', '.join(sorted(failed))}" if failed else ""))
    return 1 if failed else 0


def drop_lock(text, function):
    """text with the first absl::*MutexLock line of `function`'s body blanked, and its line number."""
    lines = text.split("\n")
    start = next((i for i, l in enumerate(lines) if re.search(re.escape(function) + r"\s*\(", l)
                  and not l.rstrip().endswith(";")), None)
    if start is None:
        return None, f"no definition of {function}"
    for i in range(start, len(lines)):
        if i > start and lines[i].startswith("}"):
            break  # the end of the function's body
        if MUTEX_LOCK.match(lines[i]):
            lines[i] = ""
            return "\n".join(lines), i + 1
    return None, f"no absl::MutexLock line in the body of {function}"


def check_drop_lock(entries, clang, spec):
    file, _, function = spec.partition(":")
    if file not in entries or not function:
        print(f"thread_safety_check: --drop-lock {spec}: want FILE:FUNCTION with FILE one of the "
              f"checked sources")
        return 2
    e = entries[file]
    src = os.path.join(e.get("directory", ""), e["file"])
    with open(src) as f:
        changed, line = drop_lock(f.read(), function)
    if changed is None:
        print(f"thread_safety_check: --drop-lock {spec}: {line}")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, os.path.basename(file))
        with open(copy, "w") as f:
            f.write(changed)
        cmd, cwd = clang_command(e, clang, copy)
        rc, out = compile_one(cmd, cwd)
    print(out, end="")
    # The mutex of the lock removed: absl::MutexLock lock(&mu_) -> mu_.
    warning = re.compile(r"requires holding mutex '[^']+'.*-Wthread-safety")
    if rc != 0 and warning.search(out):
        print(f"thread_safety_check: without the lock at {file}:{line} ({function}) clang fails "
              "with a thread-safety error, as expected")
        return 0
    print(f"thread_safety_check: without the lock at {file}:{line} ({function}) clang "
          + ("succeeded" if rc == 0 else "failed without a thread-safety error")
          + "; the analysis does not see the missing lock")
    return 1


def main():
    a = parse_args()
    if shutil.which(a.clang) is None:
        print(f"thread_safety_check: {a.clang} not found (Debian: the clang package, which "
              "scripts/install-deps.sh installs)")
        return 1
    entries = load_entries(a.build_dir, a.source_dir)
    if a.drop_lock:
        return check_drop_lock(entries, a.clang, a.drop_lock)
    return check_all(entries, a.clang, a.jobs or os.cpu_count() or 1, [os.path.normpath(f) for f in a.files])


if __name__ == "__main__":
    sys.exit(main())
