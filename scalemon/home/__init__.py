"""Where things live and who may touch them: `$SCALEMON_HOME` and run directories (`paths`),
files opened without trusting the file system (`safefs`), hub addresses and job files
(`address`, `jobfile`, `lookup`), CurveZMQ keys (`keys`), a job's history file (`history`) and
the lock that keeps one hub or relay per job (`pidlock`)."""
