from mrc_lib.cli import main

raise SystemExit(main())
