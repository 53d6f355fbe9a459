"""The GPU benchmark suite (issues 17 and 53): every number we want from one GPU window, in one go.

  python -m benchmarks.gpu OUTDIR [--dry_run] [--only NAME...] [--budget_min M] [--resume] ...

Usually started by `bash benchmarks/gpu.sh OUTDIR`, which first installs the CUDA build of JAX.
Three modules, read in this order:

- `plan`: the cases (each a `launch.py` command line), most important first, and the cost model
  that says how many of them one 15-minute window holds;
- `runner`: runs them (a compile phase of several processes at once into the shared compilation
  cache, then each case timed alone), writing OUTDIR/results.json and results.md after each;
- `report`: results.md's tables, the profile tables and the estimates beside the measurements.
"""
