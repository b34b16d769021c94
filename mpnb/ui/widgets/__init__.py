"""ipywidgets front ends: the control panel, the precision lab, fit buttons and the kernel event pump."""
