"""The `scalemon` command line: `main` (in `cli.main`) and a module per subcommand. A
subcommand imports the layer it needs (hub, dashboard, torch) inside the function that runs it,
so `scalemon jobs` never loads the dashboard, the hub or torch."""
