import sys

from sut.exits import require_environment

if __name__ == "__main__":
    require_environment()
    from sut.cli import main

    sys.exit(main())
