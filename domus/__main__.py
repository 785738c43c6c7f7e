from domus.ops.cli import main

raise SystemExit(main())
