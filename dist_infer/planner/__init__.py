"""The cost model behind `dist-infer plan` and `bench --sweep`: what each layout of the engine
computes and moves per rank (shapes, layout), how long that takes on a hardware profile
(hardware, predict), and how much memory it holds. Pure Python arithmetic; nothing runs."""
