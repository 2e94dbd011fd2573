import sys

from molt_proxy.cli import main

sys.exit(main())
