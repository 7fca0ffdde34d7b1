#!/usr/bin/env python
"""Convert a Hugging Face checkpoint to our orbax layout (same as `hybridserve convert`)."""

import sys

from hybridserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
