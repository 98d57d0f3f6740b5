"""Kipp's benchmark harness: `python -m bench --help` (protocol and results in bench/README.md).

Modules: workloads (the registry of what is measured), engines (Kipp and its peers, each run in
its own worker process), arms and runner (planning and the interleaved schedule), stats,
provenance, fallback (refusing a slower path than requested), ceiling (memory bandwidth), ppl
(quality against BF16), interop (llama.cpp on Kipp's files), records and report.
"""
