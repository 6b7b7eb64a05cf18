"""fivefold.calibration: `fivefold calibrate`, measuring the machine at hand into a device
profile (`fivefold.specs.profile`).

`timing` (how a kernel is timed), `machine` (what the machine is), the kernels: `matmul`,
`attention`, `bandwidth` (element-wise work, loss, optimizer), `overhead` (the fixed cost of
a layer); `compute` (the measurements to make), `tables` (rows into a profile) and `comm`
(collectives over spawned ranks).
"""
