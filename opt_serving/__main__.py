from opt_serving.cli import main

raise SystemExit(main())
