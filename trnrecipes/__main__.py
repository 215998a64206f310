from trnrecipes.cli import main

raise SystemExit(main())
