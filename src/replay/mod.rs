//! The replay gateway (being written).
