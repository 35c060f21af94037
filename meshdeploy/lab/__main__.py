from meshdeploy.lab.cli import main

raise SystemExit(main())
