from console.app import main

raise SystemExit(main())
