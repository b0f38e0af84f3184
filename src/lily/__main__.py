from lily.cli import main

raise SystemExit(main())
