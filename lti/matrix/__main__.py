"""`python -m lti.matrix ...`, as `lti matrix ...`."""

import sys

from lti.matrix.cli import main

if __name__ == "__main__":
    main(sys.argv[1:])
