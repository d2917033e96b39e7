"""A link to a job's hub: requests and the gapless history stream (`client`), the commands
that steer a job (`control`), and the seed a late dashboard starts from (`seed`)."""
