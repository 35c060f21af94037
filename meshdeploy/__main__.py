from meshdeploy.cli import main

raise SystemExit(main())
