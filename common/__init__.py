"""Types shared by the control plane and the workers: config, sampling params, the wire protocol."""
