from domus.cli import main

raise SystemExit(main())
