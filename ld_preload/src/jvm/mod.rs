//! The JVM face.

pub mod agent;
mod gate;
pub mod natives;
