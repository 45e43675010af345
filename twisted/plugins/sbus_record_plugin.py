"""twistd plugin ``sbus-record``: record bus traffic into Parquet files.

Lazy like the other sbus plugins: only the module name is given, so listing
plugins does not import pyarrow.
"""

from sbus.options import SbusServiceMaker as ServiceMaker  # start-up failures: one line

sbus_record = ServiceMaker(
    "sbus-record",
    "sbus.services.record",
    "Record sbus traffic into Parquet files (see docs/pipeline.md)",
    "sbus-record",
)
