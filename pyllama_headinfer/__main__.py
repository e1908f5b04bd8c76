import sys

from pyllama_headinfer.cli.main import main

sys.exit(main())
