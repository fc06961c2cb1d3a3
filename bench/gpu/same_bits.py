#!/usr/bin/env python3
"""Compares two losses.json files of bench/gpu/same-bits.sh: for each job, the steps both ran and the
first step whose loss or gradient norm differs in any bit. Exit status 0 when every common step is
identical and each job ran the same number of steps in both, 1 otherwise.

    python3 bench/gpu/same_bits.py OLD/losses.json NEW/losses.json
"""
import json
import struct
import sys


def bits(x):
    return None if x is None else struct.pack("<d", float(x))


def compare(a, b):
    ok = True
    for job in sorted(set(a) | set(b)):
        sa, sb = a.get(job, {}), b.get(job, {})
        common = sorted(set(sa) & set(sb), key=int)
        first = next((s for s in common
                      if bits(sa[s]["loss"]) != bits(sb[s]["loss"])
                      or bits(sa[s].get("grad_norm")) != bits(sb[s].get("grad_norm"))), None)
        same_len = len(sa) == len(sb) and len(common) == len(sa)
        if first is None and same_len and common:
            print(f"{job}: {len(common)} steps, every loss and gradient norm identical "
                  f"(last step {common[-1]}: loss {sa[common[-1]]['loss']!r})")
        else:
            ok = False
            where = (f"first difference at step {first}: {sa[first]} vs {sb[first]}" if first
                     else "no common step differs")
            print(f"{job}: {len(sa)} vs {len(sb)} steps; {where}")
    return ok


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    with open(sys.argv[1]) as fa, open(sys.argv[2]) as fb:
        sys.exit(0 if compare(json.load(fa), json.load(fb)) else 1)
