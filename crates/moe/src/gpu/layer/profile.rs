//! Stage profiling: a CUDA event recorded after each stage of a call when switched on.

use crate::MoeError;
use cudarc::driver::{sys::CUevent_flags, CudaEvent, CudaStream};

/// The events of the last call, `(stage, event after it)`, the first named `start`;
/// `None` when profiling is off.
#[derive(Default)]
pub(super) struct Profile {
    events: Option<Vec<(&'static str, CudaEvent)>>,
}

impl Profile {
    pub(super) fn set(&mut self, on: bool) {
        self.events = on.then(Vec::new);
    }

    /// Forgets the last call's events and records `start`.
    pub(super) fn begin(&mut self, stream: &CudaStream) -> Result<(), MoeError> {
        if let Some(events) = &mut self.events {
            events.clear();
        }
        self.mark(stream, "start")
    }

    /// Wraps a stage: its result, and when it succeeded and profiling is on, an event
    /// recorded after its launches.
    pub(super) fn stage<T>(
        &mut self,
        stream: &CudaStream,
        name: &'static str,
        result: Result<T, MoeError>,
    ) -> Result<T, MoeError> {
        let value = result?;
        self.mark(stream, name)?;
        Ok(value)
    }

    fn mark(&mut self, stream: &CudaStream, name: &'static str) -> Result<(), MoeError> {
        if let Some(events) = &mut self.events {
            let ev = stream
                .context()
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            ev.record(stream)?;
            events.push((name, ev));
        }
        Ok(())
    }

    /// Milliseconds per stage of the last call (synchronises with its events).
    pub(super) fn times(&self) -> Result<Vec<(&'static str, f32)>, MoeError> {
        let Some(events) = &self.events else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for pair in events.windows(2) {
            pair[1].1.synchronize()?;
            out.push((pair[1].0, pair[0].1.elapsed_ms(&pair[1].1)?));
        }
        Ok(out)
    }
}
