"""Tune this machine's kernels (same as ``python -m tvm_mamba tune``; see --help)."""
import sys

from tvm_mamba.cli import main

if __name__ == "__main__":
    sys.exit(main(["tune", *sys.argv[1:]]))
