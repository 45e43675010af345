"""sbus: a local pub/sub message bus over Unix SOCK_SEQPACKET sockets."""
