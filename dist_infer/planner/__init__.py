"""The cost model behind `dist-infer plan` and `bench --sweep`: what each layout of the engine
computes and moves per rank (shapes, layout), how long that takes on a hardware profile
(hardware, predict), and how much memory it holds. Pure Python arithmetic; nothing runs. (`calibrate`,
which measures this machine into a profile, runs its jobs as child commands: `topology.subcommand`.)

One layer with `bench`, below `cli` and `launch`: it imports neither."""
