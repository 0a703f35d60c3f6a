from ngramspec.cli import main

raise SystemExit(main())
