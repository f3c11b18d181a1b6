//! clawmux: an actor-based session multiplexer for the OpenClaw agent gateway.

pub mod replay;
