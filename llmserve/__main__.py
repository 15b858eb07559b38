import sys

from llmserve.cli import main

sys.exit(main())
