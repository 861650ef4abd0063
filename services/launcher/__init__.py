"""What starts the processes: the `hybridserve` command (cli.py), `hybridserve up` (stack.py) with its
supervisor (supervisor.py) and autoscaling (autoscale.py: the decision, stack_autoscale.py: the
engines started and stopped). The top layer: it imports the services, none imports it. (lifetime.py,
how a started process ends with its parent, stays beside the services: both sides use it.)"""
