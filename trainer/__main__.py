import sys

from trainer.run import main

sys.exit(main())
