import sys

from esbatch.cli import main

sys.exit(main())
