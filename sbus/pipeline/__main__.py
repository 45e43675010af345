import sys

from sbus.pipeline.cli import main

sys.exit(main())
