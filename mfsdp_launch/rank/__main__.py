from .entry import main
from .worker import leave

leave(main())
