#!/usr/bin/python3
"""Parses Prometheus text exposition files with the reference Python parser (prometheus_client,
Debian python3-prometheus-client) and prints what it read as JSON, so the C++ tests check the
exposition against an independent reader.

Usage: parse_prom.py FILE   ->  {"families": [{"name", "type", "help",
                                 "samples": [{"name", "labels": {...}, "value": "text"}]}]}
Values are printed as repr(float) strings (so NaN and infinities survive JSON). Exits 1 with the
parser's message on a malformed exposition.
"""
import json
import sys

from prometheus_client.parser import text_string_to_metric_families


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        text = f.read()
    out = []
    try:
        for fam in text_string_to_metric_families(text):
            out.append({
                "name": fam.name,
                "type": fam.type,
                "help": fam.documentation,
                "samples": [{"name": s.name, "labels": dict(s.labels), "value": repr(float(s.value))}
                            for s in fam.samples],
            })
    except Exception as e:  # the parser raises ValueError and friends on bad input
        print("parse error: %s: %s" % (type(e).__name__, e), file=sys.stderr)
        return 1
    json.dump({"families": out}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
