from kvfabric.collector.main import main

raise SystemExit(main())
